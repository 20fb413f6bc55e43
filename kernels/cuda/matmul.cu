/* MatMul y[m, n] = x[m, k] · Wᵀ (+ bias), W row-major [n, k] in f32, bf16 or f16.
 *
 * Decode-sized m (≤ kGemvMaxRows): a GEMV where each warp owns one row of W, reads it
 * once with coalesced loads and accumulates it against all m activation rows held in
 * registers; a warp reduction finishes each dot product. This is bandwidth-bound, as
 * decode is. Prefill-sized m: cuBLAS sgemm, with W widened to float32 in scratch first
 * when it is stored in 16 bits (the activations stay float32, as on the CPU path). */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

constexpr int kGemvMaxRows = 16;
constexpr int kWarpsPerBlock = 8;

template <typename T, int M>
__global__ void GemvKernel(const float* __restrict__ x, int64_t xs, const T* __restrict__ w,
                           const float* __restrict__ bias, float* __restrict__ y, int64_t ys, int m,
                           int n, int k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (j >= n) return;
  const T* wr = w + j * k;
  float acc[M];
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
  for (int i = lane; i < k; i += 32) {
    const float wv = ToF32(wr[i]);
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (r < m) acc[r] += x[r * xs + i] * wv;
    }
  }
#pragma unroll
  for (int r = 0; r < M; ++r) {
    if (r < m) {
      const float s = WarpSum(acc[r]);
      if (lane == 0) y[r * ys + j] = s + (bias ? bias[j] : 0.f);
    }
  }
}

template <typename T>
__global__ void WidenKernel(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[t] = ToF32(src[t]);
  }
}

__global__ void AddBiasKernel(float* y, int64_t ys, const float* __restrict__ bias, int m, int n) {
  const int64_t total = static_cast<int64_t>(m) * n;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[(t / n) * ys + t % n] += bias[t % n];
  }
}

int GridFor(int64_t total) {
  return static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
}

}  // namespace

absl::Status LaunchMatMul(const MatMulParams& p, cublasHandle_t cublas, float* scratch,
                          cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateMatMul(p));
  const int64_t xs = p.x_stride ? p.x_stride : p.k;
  const int64_t ys = p.y_stride ? p.y_stride : p.n;
  if (p.m <= kGemvMaxRows) {
    return DispatchDType(p.w_dtype, [&]<typename T>() {
      const int blocks = (p.n + kWarpsPerBlock - 1) / kWarpsPerBlock;
      GemvKernel<T, kGemvMaxRows><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
          p.x, xs, static_cast<const T*>(p.w), p.bias, p.y, ys, p.m, p.n, p.k);
      return LaunchStatus("GemvKernel");
    });
  }
  const float* wf = static_cast<const float*>(p.w);
  if (p.w_dtype != DType::kF32) {
    if (scratch == nullptr) return absl::InternalError("MatMul: no scratch for widening W");
    const int64_t total = static_cast<int64_t>(p.n) * p.k;
    RETURN_IF_ERROR(DispatchDType(p.w_dtype, [&]<typename T>() {
      WidenKernel<T>
          <<<GridFor(total), 256, 0, stream>>>(static_cast<const T*>(p.w), scratch, total);
      return LaunchStatus("WidenKernel");
    }));
    wf = scratch;
  }
  // Row-major Y = X·Wᵀ is column-major Yᵀ = W_cmᵀ · X_cm with W_cm = [k, n], X_cm = [k, m].
  const float alpha = 1.f, beta = 0.f;
  cublasSetStream(cublas, stream);
  const cublasStatus_t st =
      cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, p.k, &alpha, wf, p.k, p.x,
                  static_cast<int>(xs), &beta, p.y, static_cast<int>(ys));
  if (st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasSgemm failed with status ", static_cast<int>(st)));
  }
  if (p.bias) {
    AddBiasKernel<<<GridFor(static_cast<int64_t>(p.m) * p.n), 256, 0, stream>>>(p.y, ys, p.bias,
                                                                                p.m, p.n);
    return LaunchStatus("AddBiasKernel");
  }
  return absl::OkStatus();
}

}  // namespace kvwire::kernels::cuda
