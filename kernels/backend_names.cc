// The backends' names, in a file of their own: what only names a backend (a KV pool's error
// message) does not link every backend (and the CPU backend's OpenBLAS) with MakeBackend.
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace kvwire::kernels {

absl::string_view BackendName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kReference:
      return "reference";
    case BackendKind::kCpu:
      return "cpu";
    case BackendKind::kCuda:
      return "cuda";
    case BackendKind::kGuarded:
      return "guarded";
  }
  return "?";
}

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name) {
  if (name == "reference") return BackendKind::kReference;
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  if (name == "guarded") return BackendKind::kGuarded;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", name, "'; expected reference, cpu, cuda or guarded"));
}

}  // namespace kvwire::kernels
