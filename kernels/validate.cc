#include "kernels/validate.h"

#include <concepts>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire::kernels {
namespace {

absl::Status Require(bool ok, absl::string_view op, absl::string_view what) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// A message with values in it, formatted only on failure: the checks run on every call, and
// decode attention is called per cache head on a host backend.
template <std::invocable Message>
absl::Status Require(bool ok, absl::string_view op, const Message& what) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what()));
}

}  // namespace

absl::Status ValidateMatMul(const MatMulParams& p) {
  RETURN_IF_ERROR(Require(p.x && p.w && p.y, "MatMul", "x, w and y must be set"));
  RETURN_IF_ERROR(Require(p.m > 0 && p.n > 0 && p.k > 0, "MatMul", [&] {
    return absl::StrCat("sizes must be positive, got m=", p.m, " n=", p.n, " k=", p.k);
  }));
  RETURN_IF_ERROR(Require(p.x_stride == 0 || p.x_stride >= p.k, "MatMul", "x_stride < k"));
  RETURN_IF_ERROR(Require(p.y_stride == 0 || p.y_stride >= p.n, "MatMul", "y_stride < n"));
  return absl::OkStatus();
}

absl::Status ValidateRmsNorm(const RmsNormParams& p) {
  RETURN_IF_ERROR(Require(p.x && p.weight && p.y, "RmsNorm", "x, weight and y must be set"));
  return Require(p.rows > 0 && p.dim > 0 && p.eps >= 0, "RmsNorm", [&] {
    return absl::StrCat("need rows, dim > 0 and eps >= 0, got rows=", p.rows, " dim=", p.dim,
                        " eps=", p.eps);
  });
}

absl::Status ValidateRope(const RopeParams& p) {
  RETURN_IF_ERROR(
      Require(p.x && p.positions && p.inv_freq, "Rope", "x, positions and inv_freq must be set"));
  RETURN_IF_ERROR(Require(p.head_dim > 0 && p.head_dim % 2 == 0, "Rope",
                          [&] { return absl::StrCat("head_dim must be even, got ", p.head_dim); }));
  return Require(p.rows > 0 && p.heads > 0 && p.row_stride >= int64_t{p.heads} * p.head_dim, "Rope",
                 "need rows, heads > 0 and row_stride >= heads * head_dim");
}

absl::Status ValidateSwiGlu(const SwiGluParams& p) {
  RETURN_IF_ERROR(Require(p.gate_up && p.out, "SwiGlu", "gate_up and out must be set"));
  return Require(p.rows > 0 && p.ffn > 0, "SwiGlu", "rows and ffn must be positive");
}

absl::Status ValidatePrefillAttention(const PrefillAttentionParams& p) {
  constexpr absl::string_view kOp = "PrefillAttention";
  RETURN_IF_ERROR(Require(p.q && p.k && p.v && p.out, kOp, "q, k, v and out must be set"));
  RETURN_IF_ERROR(Require(p.len > 0 && p.head_dim > 0 && p.n_kv_heads > 0 &&
                              p.n_heads >= p.n_kv_heads && p.n_heads % p.n_kv_heads == 0,
                          kOp, [&] {
                            return absl::StrCat(
                                "need len, head_dim > 0 and n_heads a multiple of "
                                "n_kv_heads, got len=",
                                p.len, " n_heads=", p.n_heads, " n_kv_heads=", p.n_kv_heads);
                          }));
  RETURN_IF_ERROR(Require(p.q_stride >= int64_t{p.n_heads} * p.head_dim &&
                              p.kv_stride >= int64_t{p.n_kv_heads} * p.head_dim &&
                              p.out_stride >= int64_t{p.n_heads} * p.head_dim,
                          kOp, "a row stride is smaller than its heads · head_dim"));
  RETURN_IF_ERROR(Require(p.window >= 0 && p.window <= p.len, kOp, [&] {
    return absl::StrCat("window must be in [0, len=", p.len, "], got ", p.window);
  }));
  return Require(p.window == 0 || p.window_scores, kOp, "window > 0 needs window_scores");
}

absl::Status ValidateDecodeAttention(const DecodeAttentionParams& p) {
  constexpr absl::string_view kOp = "DecodeAttention";
  RETURN_IF_ERROR(Require(p.batch >= 0 && (p.batch == 0 || p.seqs), kOp, "seqs must be set"));
  RETURN_IF_ERROR(Require(p.head_dim > 0 && p.n_cache_heads > 0 && p.n_heads >= p.n_cache_heads &&
                              p.n_heads % p.n_cache_heads == 0,
                          kOp, [&] {
                            return absl::StrCat("n_heads must be a multiple of n_cache_heads, got ",
                                                p.n_heads, " and ", p.n_cache_heads);
                          }));
  for (int b = 0; b < p.batch; ++b) {
    const DecodeSequence& s = p.seqs[b];
    RETURN_IF_ERROR(Require(s.q && s.out && s.k && s.v, kOp, [&] {
      return absl::StrCat("sequence ", b, ": q, out, k and v must be set");
    }));
    RETURN_IF_ERROR(Require(s.len > 0 && s.head_stride >= int64_t{s.len} * p.head_dim, kOp, [&] {
      return absl::StrCat("sequence ", b,
                          ": need len > 0 and head_stride >= len · "
                          "head_dim, got len=",
                          s.len, " head_stride=", s.head_stride);
    }));
    if (s.indices) {
      RETURN_IF_ERROR(Require(s.num_indices > 0 && s.num_indices <= s.len, kOp, [&] {
        return absl::StrCat("sequence ", b, ": num_indices must be in [1, len=", s.len, "], got ",
                            s.num_indices);
      }));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateAdd(const AddParams& p) {
  return Require(p.n >= 0 && (p.n == 0 || (p.x && p.y)), "Add",
                 "x and y must be set and n must be >= 0");
}

absl::Status ValidateAppendKv(const AppendKvParams& p) {
  constexpr absl::string_view kOp = "AppendKv";
  RETURN_IF_ERROR(Require(p.batch >= 0 && (p.batch == 0 || p.seqs), kOp, "seqs must be set"));
  RETURN_IF_ERROR(Require(p.head_dim > 0 && p.n_kv_heads > 0 && p.n_cache_heads >= p.n_kv_heads &&
                              p.n_cache_heads % p.n_kv_heads == 0,
                          kOp, [&] {
                            return absl::StrCat(
                                "n_cache_heads must be a multiple of n_kv_heads, got ",
                                p.n_cache_heads, " and ", p.n_kv_heads);
                          }));
  for (int b = 0; b < p.batch; ++b) {
    const KvAppend& s = p.seqs[b];
    RETURN_IF_ERROR(Require(s.k && s.v && s.k_cache && s.v_cache, kOp, [&] {
      return absl::StrCat("sequence ", b, ": k, v, k_cache and v_cache must be set");
    }));
    RETURN_IF_ERROR(Require(s.t >= 0 && s.head_stride >= (int64_t{s.t} + 1) * p.head_dim, kOp, [&] {
      return absl::StrCat("sequence ", b, ": token ", s.t, " does not fit a head_stride of ",
                          s.head_stride, " elements");
    }));
  }
  return absl::OkStatus();
}

}  // namespace kvwire::kernels
