/* MatMul y[m, n] = x[m, k] · Wᵀ (+ bias), W row-major [n, k] in f32, bf16 or f16.
 *
 * With bf16 W, x is rounded to bf16 first (backend.h): each product is then exact in
 * float32, as on tensor cores.
 *
 * Decode-sized m (≤ kGemvMaxRows): a GEMV where each warp owns one row of W and reads it
 * once, 16 bytes per lane per load (4 loads in flight), against the m activation rows, and
 * a warp reduction finishes each dot product. Decode is bound by reading W, so the loads
 * are what matters. Rows whose length or address does not allow 16-byte loads take the
 * same kernel one element per lane.
 *
 * Prefill-sized m: cuBLAS. bf16 W: x rounded to bf16 into scratch, then cublasGemmEx with
 * bf16 inputs and float32 accumulation and output (the tensor cores). f32 W: cublasSgemm
 * (no TF32: the product is float32's). f16 W: widened to float32 in scratch, then
 * cublasSgemm, since the reference multiplies unrounded x by f16 W. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {
namespace {

constexpr int kGemvMaxRows = 16;
constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 4;

// x as the product sees it: rounded to bf16 against bf16 weights.
template <typename T>
__device__ __forceinline__ float RoundX(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(__float2bfloat16_rn(x));
  } else {
    return x;
  }
}

// One warp per row j of W. kVec: W rows and x rows allow 16-byte loads (aligned, k a
// multiple of the vector), each lane taking V = 16 / sizeof(T) consecutive elements a step.
template <typename T, int M, bool kVec>
__global__ void GemvKernel(const float* __restrict__ x, int64_t xs, const T* __restrict__ w,
                           const float* __restrict__ bias, float* __restrict__ y, int64_t ys, int m,
                           int n, int k) {
  constexpr int V = kVec ? 16 / sizeof(T) : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (j >= n) return;
  const T* wr = w + j * k;
  float acc[M];
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
  auto step = [&](const T* wv, int i) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float we = ToF32(wv[e]);
#pragma unroll
      for (int r = 0; r < M; ++r) {
        if (r < m) acc[r] += RoundX<T>(x[r * xs + i + e]) * we;
      }
    }
  };
  constexpr int kStep = 32 * V;
  int i = lane * V;
  if constexpr (kVec) {
    // kUnroll independent 16-byte loads in flight per lane before the arithmetic.
    for (; i + (kUnroll - 1) * kStep < k; i += kUnroll * kStep) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        raw[u] = __ldg(reinterpret_cast<const uint4*>(wr + i + u * kStep));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) step(reinterpret_cast<const T*>(&raw[u]), i + u * kStep);
    }
    for (; i < k; i += kStep) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(wr + i));
      step(reinterpret_cast<const T*>(&raw), i);
    }
  } else {
    for (; i < k; i += kStep) step(wr + i, i);
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

// x [m, k] (row stride xs) rounded to bf16, packed [m, k].
__global__ void RoundToBf16Kernel(const float* __restrict__ x, int64_t xs, __nv_bfloat16* dst,
                                  int m, int k) {
  const int64_t total = static_cast<int64_t>(m) * k;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[t] = __float2bfloat16_rn(x[(t / k) * xs + t % k]);
  }
}

__global__ void AddBiasKernel(float* y, int64_t ys, const float* __restrict__ bias, int m, int n) {
  const int64_t total = static_cast<int64_t>(m) * n;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[(t / n) * ys + t % n] += bias[t % n];
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, int M>
absl::Status LaunchGemv(const MatMulParams& p, int64_t xs, int64_t ys, cudaStream_t stream) {
  const int blocks = (p.n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  constexpr int V = 16 / sizeof(T);
  const bool vec = Aligned16(p.w) && p.k % V == 0;
  if (vec) {
    GemvKernel<T, M, true><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
        p.x, xs, static_cast<const T*>(p.w), p.bias, p.y, ys, p.m, p.n, p.k);
  } else {
    GemvKernel<T, M, false><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
        p.x, xs, static_cast<const T*>(p.w), p.bias, p.y, ys, p.m, p.n, p.k);
  }
  return LaunchStatus("GemvKernel");
}

int GridFor(int64_t total) {
  return static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
}

}  // namespace

size_t MatMulScratchBytes(const MatMulParams& p) {
  if (p.m <= kGemvMaxRows) return 0;
  switch (p.w_dtype) {
    case DType::kBF16:
      return static_cast<size_t>(p.m) * p.k * sizeof(__nv_bfloat16);
    case DType::kF16:
      return static_cast<size_t>(p.n) * p.k * sizeof(float);
    case DType::kF32:
      return 0;
  }
  return 0;
}

absl::Status LaunchMatMul(const MatMulParams& p, cublasHandle_t cublas, void* scratch,
                          cudaStream_t stream) {
  const int64_t xs = p.x_stride ? p.x_stride : p.k;
  const int64_t ys = p.y_stride ? p.y_stride : p.n;
  if (p.m <= kGemvMaxRows) {
    return DispatchDType(p.w_dtype, [&]<typename T>() {
      if (p.m == 1) return LaunchGemv<T, 1>(p, xs, ys, stream);
      if (p.m <= 2) return LaunchGemv<T, 2>(p, xs, ys, stream);
      if (p.m <= 4) return LaunchGemv<T, 4>(p, xs, ys, stream);
      if (p.m <= 8) return LaunchGemv<T, 8>(p, xs, ys, stream);
      return LaunchGemv<T, kGemvMaxRows>(p, xs, ys, stream);
    });
  }
  if (MatMulScratchBytes(p) > 0 && scratch == nullptr) {
    return absl::InternalError("MatMul: no scratch buffer");
  }
  // Row-major Y = X·Wᵀ is column-major Yᵀ = W_cmᵀ · X_cm with W_cm = [k, n], X_cm = [k, m].
  // Through cuBLAS's 64-bit API: a 16K-token prefill's logits over a 128K vocabulary are 2^31
  // elements.
  const float alpha = 1.f, beta = 0.f;
  cublasStatus_t st;
  const char* call;
  if (p.w_dtype == DType::kBF16) {
    auto* xb = static_cast<__nv_bfloat16*>(scratch);
    RoundToBf16Kernel<<<GridFor(static_cast<int64_t>(p.m) * p.k), 256, 0, stream>>>(p.x, xs, xb,
                                                                                    p.m, p.k);
    RETURN_IF_ERROR(LaunchStatus("RoundToBf16Kernel"));
    call = "cublasGemmEx_64 (bf16 x bf16 -> f32)";
    st = cublasGemmEx_64(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, p.k, &alpha, p.w, CUDA_R_16BF,
                         p.k, xb, CUDA_R_16BF, p.k, &beta, p.y, CUDA_R_32F, ys, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
  } else {
    const float* wf = static_cast<const float*>(p.w);
    if (p.w_dtype == DType::kF16) {
      const int64_t total = static_cast<int64_t>(p.n) * p.k;
      WidenKernel<__half><<<GridFor(total), 256, 0, stream>>>(static_cast<const __half*>(p.w),
                                                              static_cast<float*>(scratch), total);
      RETURN_IF_ERROR(LaunchStatus("WidenKernel"));
      wf = static_cast<const float*>(scratch);
    }
    call = "cublasSgemm_64";
    st = cublasSgemm_64(cublas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, p.k, &alpha, wf, p.k, p.x, xs,
                        &beta, p.y, ys);
  }
  RETURN_IF_ERROR(CublasStatus(st, call));
  if (p.bias) {
    AddBiasKernel<<<GridFor(static_cast<int64_t>(p.m) * p.n), 256, 0, stream>>>(p.y, ys, p.bias,
                                                                                p.m, p.n);
    return LaunchStatus("AddBiasKernel");
  }
  return absl::OkStatus();
}

}  // namespace kvwire::kernels::cuda
