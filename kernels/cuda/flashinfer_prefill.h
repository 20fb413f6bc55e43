// Prefill attention through FlashInfer's single-request prefill (FA3 on an sm_90 GPU where it
// was built, FA2 on tensor cores elsewhere: causal, GQA, the queries of rows [q_begin, len) over
// every key), for a bf16 model
// (PrefillAttentionParams::precision) with head_dim 64 or 128. q, k and v are rounded to bf16
// into scratch rows first and the output widened back into `out`; the observation window's
// scores, which FlashInfer does not return, are then a cuBLAS product per KV head
// (LaunchWindowScores, in f32). Built where CMake found FlashInfer's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {

bool FlashInferPrefillServes(const PrefillAttentionParams& p);
// Whether FA3 was built and this thread's device is sm_90 (Hopper: H100, H200).
bool FlashInferFa3Serves();
// The rows FlashInfer computes, through FA3 when `fa3` (the caller checked FlashInferFa3Serves),
// else FA2; the window's scores are the caller's (LaunchWindowScores).
absl::Status LaunchFlashInferPrefill(const PrefillAttentionParams& p, const OpMemory& mem,
                                     cudaStream_t stream, bool fa3);
// Calls so far, all of them and those through FA3.
int64_t FlashInferPrefillLaunches();
int64_t FlashInferFa3PrefillLaunches();

}  // namespace kvwire::kernels::cuda
