// Prefill attention through FlashInfer's single-request prefill (FA2 on tensor cores: causal,
// GQA, the queries of rows [q_begin, len) over every key), for a bf16 model
// (PrefillAttentionParams::precision) with head_dim 64 or 128. q, k and v are rounded to bf16
// into scratch rows first and the output widened back into `out`; the observation window's
// rows are then computed again by kvwire's kernel, which writes their scores (FlashInfer returns
// no probabilities) and their outputs in f32. Built where CMake found FlashInfer's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {

bool FlashInferPrefillServes(const PrefillAttentionParams& p);
// The rows FlashInfer computes; the window's scores are the caller's (LaunchPrefillAttention
// over the window's rows).
absl::Status LaunchFlashInferPrefill(const PrefillAttentionParams& p, const OpMemory& mem,
                                     cudaStream_t stream);
int64_t FlashInferPrefillLaunches();

}  // namespace kvwire::kernels::cuda
