// A kernel's template arguments from a call's dtype and head_dim, for the launchers. Included by
// kernels/cuda/cuda_util.cuh after CUDA's element types (and by the emulation's stand-in for it,
// tests/kernels/emulated, after its own), so both dispatch alike.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/dtype.h"

namespace kvwire::kernels::cuda {

// Calls f.template operator()<T>() with the CUDA element type of `dtype`.
template <typename F>
absl::Status DispatchDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32:
      return f.template operator()<float>();
    case DType::kBF16:
      return f.template operator()<__nv_bfloat16>();
    case DType::kF16:
      return f.template operator()<__half>();
  }
  return absl::InvalidArgumentError("unsupported dtype");
}

// Maps head_dim to the number of dims each lane of a warp owns (a compile-time constant),
// FlashInfer style: the default case says what is unsupported.
template <typename F>
absl::Status DispatchHeadDim(int head_dim, F&& f) {
  if (head_dim <= 32) return f.template operator()<1>();
  if (head_dim <= 64) return f.template operator()<2>();
  if (head_dim <= 128) return f.template operator()<4>();
  if (head_dim <= 256) return f.template operator()<8>();
  return absl::InvalidArgumentError(
      absl::StrCat("CUDA attention supports head_dim up to 256, got ", head_dim));
}

}  // namespace kvwire::kernels::cuda
