// The top-k of TopK's runs through FlashInfer's filtered top-k (topk.cuh's FilteredTopK: one
// block per row, a radix select over the row in shared memory, no sort of the row), where CUB's
// segmented radix sort ranked every run of the row, all 64 bits of its key, to keep a few.
// top_k.cu stages the rows, asks for the best `k` of each, and orders and expands them itself.
//
// Built only where CMake found FlashInfer's headers (KVWIRE_HAVE_FLASHINFER).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvwire::kernels::cuda {

// The most items FlashInfer's filtered top-k takes from a row (its shared index buffer).
inline constexpr int kFlashInferTopKMax = 2048;

// Whether this device gives a block the shared memory the kernel takes (128 KiB).
bool FlashInferTopKAvailable();

// For each of `rows` rows of `row_stride` floats at `scores`, of which row r's first lengths[r]
// are read (lengths on the device): the indices of its k largest into out[r · k ...], equal
// values taken lowest index first (TopKTieBreak::Small), in no particular order; a row of k or
// fewer gives 0 .. length − 1, then −1. FlashInfer ranks a float by its bits: the caller gives
// neither NaN nor −0. 1 ≤ k ≤ kFlashInferTopKMax.
absl::Status LaunchFlashInferTopK(const float* scores, const int32_t* lengths, int rows,
                                  int row_stride, int k, int32_t* out, cudaStream_t stream);

// Calls that went through FlashInfer since the process started (tests check the path ran).
int64_t FlashInferTopKLaunches();

}  // namespace kvwire::kernels::cuda
