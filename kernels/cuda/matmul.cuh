/* MatMul's decode-sized kernel (matmul.cu launches it, and says when): y[m, n] = x[m, k] · Wᵀ
 * (+ bias) for m ≤ kGemvMaxRows, a GEMV where each warp owns one row of W and reads it once,
 * 16 bytes per lane per load (4 loads in flight), against the m activation rows, and a warp
 * reduction finishes each dot product. Decode is bound by reading W, so the loads are what
 * matters. Rows whose length or address does not allow 16-byte loads take the same kernel one
 * element per lane. With bf16 W, x is rounded to bf16 first (backend.h): each product is then
 * exact in float32; one row of x is rounded in the loop, more by RoundRowsKernel beforehand.
 * Tested against the reference by BackendOpsTest.MatMul on cuda and, where no GPU is, in
 * tests/kernels/emulated. */
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace kvwire::kernels::cuda::decode_gemv {

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

// x's m rows rounded to bf16, as floats, packed [m, k]: what the GEMV against bf16 W reads for
// more than one row, where rounding each element in its loop took an F2F beside every FFMA,
// once per row of W (at 8 rows near a third of the memory's rate). A thread per element.
__global__ void RoundRowsKernel(const float* __restrict__ x, int64_t xs, float* __restrict__ dst,
                                int m, int k) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<int64_t>(m) * k) return;
  dst[t] = __bfloat162float(__float2bfloat16_rn(x[(t / k) * xs + t % k]));
}

// One warp per row j of W. kVec: W rows allow 16-byte loads (aligned, k a multiple of the
// vector), each lane taking V = 16 / sizeof(T) consecutive elements a step; with `x_vec` (x's
// rows 16-byte aligned too) the V elements of each x row come in 16-byte loads as well, where
// one 4-byte load each made a batch of 8 rows issue 64 loads per load of W. kRoundX: round x
// as the product sees it here (false: RoundRowsKernel has).
template <typename T, int M, bool kVec, bool kRoundX = true>
__global__ void GemvKernel(const float* __restrict__ x, int64_t xs, bool x_vec,
                           const T* __restrict__ w, const float* __restrict__ bias,
                           float* __restrict__ y, int64_t ys, int m, int n, int k) {
  constexpr int V = kVec ? 16 / sizeof(T) : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (j >= n) return;
  const T* wr = w + j * k;
  float acc[M];
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
  auto step = [&](const T* wv, int i) {
    float we[V];
#pragma unroll
    for (int e = 0; e < V; ++e) we[e] = ToF32(wv[e]);
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (r >= m) continue;
      const float* xr = x + r * xs + i;
      if constexpr (kVec) {
        if (x_vec) {
          alignas(16) float xv[V];
#pragma unroll
          for (int u = 0; u < V; u += 4) {
            *reinterpret_cast<float4*>(xv + u) = __ldg(reinterpret_cast<const float4*>(xr + u));
          }
#pragma unroll
          for (int e = 0; e < V; ++e) acc[r] += (kRoundX ? RoundX<T>(xv[e]) : xv[e]) * we[e];
          continue;
        }
      }
#pragma unroll
      for (int e = 0; e < V; ++e) acc[r] += (kRoundX ? RoundX<T>(xr[e]) : xr[e]) * we[e];
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

// Whether x is rounded by RoundRowsKernel (into scratch of GemvScratchBytes) before the GEMV.
__host__ inline bool GemvRoundsFirst(const MatMulParams& p) {
  return p.w_dtype == DType::kBF16 && p.m >= 2;
}
__host__ inline size_t GemvScratchBytes(const MatMulParams& p) {
  return GemvRoundsFirst(p) ? sizeof(float) * p.m * p.k : 0;
}

// How LaunchMatMul runs a decode-sized product: which kernel, and its loads of x (at x, rows xs
// apart: p.x, or the rounded rows).
struct Gemv {
  bool vec = false, x_vec = false;
  int blocks = 0;
};
__host__ inline Gemv GemvFor(const MatMulParams& p, const float* x, int64_t xs, int elem_bytes) {
  auto aligned16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const int v = 16 / elem_bytes;
  Gemv g;
  g.vec = aligned16(p.w) && p.k % v == 0;
  g.x_vec = g.vec && aligned16(x) && xs % 4 == 0;
  g.blocks = (p.n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return g;
}

// Calls f.template operator()<M>() with the rows a GEMV kernel is built for, m ≤ M.
template <typename F>
absl::Status DispatchRows(int m, F&& f) {
  if (m == 1) return f.template operator()<1>();
  if (m <= 2) return f.template operator()<2>();
  if (m <= 4) return f.template operator()<4>();
  if (m <= 8) return f.template operator()<8>();
  return f.template operator()<kGemvMaxRows>();
}

}  // namespace kvwire::kernels::cuda::decode_gemv
