// Status helpers. Abseil 20220623 has no RETURN_IF_ERROR / ASSIGN_OR_RETURN, so we
// carry our own. Every fallible function in kvwire returns absl::Status or
// absl::StatusOr<T>; programmer errors are KVWIRE_CHECKs that abort.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

#define KVWIRE_STATUS_CONCAT_INNER(a, b) a##b
#define KVWIRE_STATUS_CONCAT(a, b) KVWIRE_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status kvwire_status_ = (expr);          \
    if (!kvwire_status_.ok()) return kvwire_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Foo());` or `ASSIGN_OR_RETURN(x, Foo());`
#define ASSIGN_OR_RETURN(lhs, expr) \
  KVWIRE_ASSIGN_OR_RETURN_IMPL(KVWIRE_STATUS_CONCAT(kvwire_statusor_, __LINE__), lhs, expr)

#define KVWIRE_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr)  \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

// Aborts with a message: for invariants that only a bug in kvwire can break.
#define KVWIRE_CHECK(cond)                                                          \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)

namespace kvwire {

// The request field an error is about ("sampling.top_p", "compression.kernel"), carried with
// the status so that the gRPC layer can name it in google.rpc.BadRequest and clients need not
// parse the message.
inline constexpr absl::string_view kFieldPayload = "type.kvwire.dev/field";
inline absl::Status AboutField(absl::Status status, absl::string_view field) {
  if (!status.ok()) status.SetPayload(kFieldPayload, absl::Cord(field));
  return status;
}
inline std::optional<std::string> FieldOf(const absl::Status& status) {
  if (auto field = status.GetPayload(kFieldPayload)) return std::string(*field);
  return std::nullopt;
}

// Prefixes a status message with context ("loading model.safetensors: ...") and keeps the
// code, so the caller learns both what failed and where.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace kvwire
