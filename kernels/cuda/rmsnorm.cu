/* RMSNorm: y = x / sqrt(mean(x²) + eps) · w, and its fused form with the residual add before
 * it (residual += x, then the norm of the sum). One block per row; each thread sums the
 * squares of a strided slice, a warp-shuffle then shared-memory reduction gives the row's
 * sum, and the same threads scale their slice. Matches ReferenceBackend::RmsNorm. The fused
 * form in place goes to FlashInfer's FusedAddRMSNorm where it is built (flashinfer_norm.h). */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"
#if KVWIRE_HAVE_FLASHINFER
#include "kernels/cuda/flashinfer_norm.h"
#endif

namespace kvwire::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// x and y may alias (backend.h): no __restrict__ on them. With `residual`, each thread adds
// its slice of x into it and later reads back only what it wrote.
__global__ void RmsNormKernel(const float* x, const float* __restrict__ w, float* y,
                              float* __restrict__ residual, int dim, float eps) {
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * dim;
  float* yr = y + static_cast<int64_t>(blockIdx.x) * dim;
  float ss = 0.f;
  if (residual != nullptr) {
    float* rr = residual + static_cast<int64_t>(blockIdx.x) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
      const float s = rr[i] + xr[i];
      rr[i] = s;
      ss += s * s;
    }
    xr = rr;
  } else {
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  }
  __shared__ float partial[kThreads / 32];
  ss = WarpSum(ss);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.f;
    v = WarpSum(v);
    if (threadIdx.x == 0) partial[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

}  // namespace

absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateRmsNorm(p));
#if KVWIRE_HAVE_FLASHINFER
  if (FlashInferAddRmsNormServes(p)) return LaunchFlashInferAddRmsNorm(p, stream);
#endif
  RmsNormKernel<<<p.rows, kThreads, 0, stream>>>(p.x, p.weight, p.y, p.residual, p.dim, p.eps);
  return LaunchStatus("RmsNormKernel");
}

}  // namespace kvwire::kernels::cuda
