/* The fused residual add and RMSNorm through FlashInfer (flashinfer_norm.h), its template
 * instantiated here for f32 rows. Tested against ReferenceBackend::RmsNorm by
 * BackendOpsTest.RmsNormWithResidual on cuda. */
#include <atomic>
#include <cstdint>
#include <exception>
#include <flashinfer/norm.cuh>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/flashinfer_norm.h"

namespace kvwire::kernels::cuda {
namespace {

std::atomic<int64_t> launches{0};

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool FlashInferAddRmsNormServes(const RmsNormParams& p) {
  return p.residual != nullptr && p.x == p.y && p.dim % 4 == 0 && Aligned16(p.x) &&
         Aligned16(p.residual) && Aligned16(p.weight);
}

absl::Status LaunchFlashInferAddRmsNorm(const RmsNormParams& p, cudaStream_t stream) try {
  // FlashInfer takes mutable pointers for what it only reads (the weight).
  RETURN_IF_ERROR(CudaStatus(
      flashinfer::norm::FusedAddRMSNorm<float>(
          p.y, p.residual, const_cast<float*>(p.weight), static_cast<uint32_t>(p.rows),
          static_cast<uint32_t>(p.dim), /*stride_input=*/static_cast<uint32_t>(p.dim),
          /*stride_residual=*/static_cast<uint32_t>(p.dim), p.eps, /*enable_pdl=*/false, stream),
      "FlashInfer FusedAddRMSNorm"));
  launches.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
} catch (const std::exception& e) {  // FlashInfer reports what it cannot run by throwing
  return absl::InternalError(absl::StrCat("FlashInfer FusedAddRMSNorm: ", e.what()));
}

int64_t FlashInferNormLaunches() { return launches.load(std::memory_order_relaxed); }

}  // namespace kvwire::kernels::cuda
