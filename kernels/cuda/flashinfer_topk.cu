/* FlashInfer's filtered top-k for TopK (flashinfer_topk.h), its template instantiated here for
 * float scores and int32 indices. Tested against ReferenceBackend::TopK by
 * BackendOpsTest.TopKRanksAsTheReferenceDoes on cuda. */
#include <atomic>
#include <cstdint>
#include <exception>
// topk.cuh uses math.cuh's math::ptx_rcp without including it (sampling.cuh, which FlashInfer
// includes first, brings it).
#include <flashinfer/math.cuh>
#include <flashinfer/topk.cuh>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/flashinfer_topk.h"

namespace kvwire::kernels::cuda {
namespace {

std::atomic<int64_t> launches{0};

}  // namespace

static_assert(kFlashInferTopKMax == static_cast<int>(flashinfer::sampling::FILTERED_TOPK_MAX_K));

bool FlashInferTopKAvailable() {
  // FlashInfer checks a multiprocessor's shared memory; a block's opt-in limit must hold the
  // kernel's dynamic 128 KiB and its static arrays (about 12 KiB) as well.
  int device = 0, optin = 0;
  return flashinfer::sampling::CanImplementFilteredTopK() &&
         cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
             cudaSuccess &&
         static_cast<size_t>(optin) >= flashinfer::sampling::FILTERED_TOPK_SMEM_DYNAMIC + 24 * 1024;
}

absl::Status LaunchFlashInferTopK(const float* scores, const int32_t* lengths, int rows,
                                  int row_stride, int k, int32_t* out, cudaStream_t stream) try {
  if (rows <= 0) return absl::OkStatus();
  if (k < 1 || k > kFlashInferTopKMax || row_stride < 1) {
    return absl::InvalidArgumentError(absl::StrCat("FlashInfer top-k: k is ", k, " of rows of ",
                                                   row_stride, "; expected 1 to ",
                                                   kFlashInferTopKMax, " of rows of at least 1"));
  }
  // Plain mode: no values out, no page table. FlashInfer takes mutable pointers for what it only
  // reads (the scores).
  RETURN_IF_ERROR(CudaStatus(
      flashinfer::sampling::FilteredTopK<float, int32_t>(
          const_cast<float*>(scores), out, /*output_values=*/nullptr, lengths,
          static_cast<uint32_t>(rows), static_cast<uint32_t>(k), static_cast<uint32_t>(row_stride),
          /*deterministic=*/true, flashinfer::sampling::TopKTieBreak::Small, stream),
      "FlashInfer FilteredTopK"));
  launches.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
} catch (const std::exception& e) {  // FlashInfer reports what it cannot run by throwing
  return absl::InternalError(absl::StrCat("FlashInfer FilteredTopK: ", e.what()));
}

int64_t FlashInferTopKLaunches() { return launches.load(std::memory_order_relaxed); }

}  // namespace kvwire::kernels::cuda
