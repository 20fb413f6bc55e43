// The residual add fused into RMSNorm through FlashInfer's FusedAddRMSNorm (norm.cuh), in f32:
// residual += x, then x = the norm of the sum, in place. Built where CMake found FlashInfer's
// headers; LaunchRmsNorm (rmsnorm.cu) calls it for the fused form it serves and runs kvwire's
// kernel for the rest.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace kvwire::kernels::cuda {

// The fused form in place (y == x), with rows of a whole number of 16-byte vectors on 16-byte
// boundaries (FlashInfer's vector loads).
bool FlashInferAddRmsNormServes(const RmsNormParams& p);
absl::Status LaunchFlashInferAddRmsNorm(const RmsNormParams& p, cudaStream_t stream);
int64_t FlashInferNormLaunches();

}  // namespace kvwire::kernels::cuda
