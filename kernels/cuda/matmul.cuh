/* MatMul's decode-sized kernel (matmul.cu launches it, and says when): y[m, n] = x[m, k] · Wᵀ
 * (+ bias) for m ≤ kGemvMaxRows, a GEMV where each warp owns 1, 2 or 4 rows of W and reads
 * them once, 16 bytes per lane per load (4 loads a row in flight), against the m activation
 * rows, and a warp reduction finishes each dot product. Decode is bound by reading W, so the loads
 * are what matters. Rows whose length or address does not allow 16-byte loads take the same kernel
 * one element per lane. With bf16 W, x is rounded to bf16 first (backend.h): each product is then
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
constexpr int kRowsPerBlock = 8;  // rows of W a block owns: 8 warps of one row, 2 of four
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

// Rows of W a warp owns: each element of x it loads (and, rounding in the loop, rounds) serves R
// rows of W, where with one row each the rows of x came from L1 once per row of W (at 8 rows of
// x, 16 16-byte loads of x per 16-byte load of W). A block owns kRowsPerBlock rows whatever R
// (kRowsPerBlock / R warps), so that a product of few rows still spreads over every SM.
__host__ __device__ constexpr int GemvRowsPerWarp(int m_rows) {
  return m_rows == 1 ? 1 : (m_rows == 2 ? 2 : 4);
}

// Warps own R = GemvRowsPerWarp(M) rows of W each, from j0. kVec: W rows allow 16-byte loads
// (aligned, k a multiple of the vector), each lane taking V = 16 / sizeof(T) consecutive elements
// a step; with `x_vec` (x's rows 16-byte aligned too) the V elements of each x row come in
// 16-byte loads as well, where one 4-byte load each made a batch of 8 rows issue 64 loads per
// load of W. kRoundX: round x as the product sees it here (false: RoundRowsKernel has).
template <typename T, int M, bool kVec, bool kRoundX = true>
__global__ void GemvKernel(const float* __restrict__ x, int64_t xs, bool x_vec,
                           const T* __restrict__ w, const float* __restrict__ bias,
                           float* __restrict__ y, int64_t ys, int m, int n, int k) {
  constexpr int V = kVec ? 16 / sizeof(T) : 1;
  constexpr int R = GemvRowsPerWarp(M);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + int64_t{warp} * R;
  if (j0 >= n) return;
  const int rows = n - j0 < R ? static_cast<int>(n - j0) : R;  // the last warp's may be fewer
  float acc[R][M];
#pragma unroll
  for (int q = 0; q < R; ++q) {
#pragma unroll
    for (int r = 0; r < M; ++r) acc[q][r] = 0.f;
  }
  // The V elements at i of each of the R rows of W (0 past the last row) against x's rows.
  auto step = [&](const float(&we)[R][V], int i) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (r >= m) continue;
      const float* xr = x + r * xs + i;
      alignas(16) float xv[V];
      bool loaded = false;
      if constexpr (kVec) {
        if (x_vec) {
#pragma unroll
          for (int u = 0; u < V; u += 4) {
            *reinterpret_cast<float4*>(xv + u) = __ldg(reinterpret_cast<const float4*>(xr + u));
          }
          loaded = true;
        }
      }
      if (!loaded) {
#pragma unroll
        for (int e = 0; e < V; ++e) xv[e] = xr[e];
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float xe = kRoundX ? RoundX<T>(xv[e]) : xv[e];
#pragma unroll
        for (int q = 0; q < R; ++q) acc[q][r] += xe * we[q][e];
      }
    }
  };
  constexpr int kStep = 32 * V;
  int i = lane * V;
  if constexpr (kVec) {
    auto widen = [&](const uint4(&raw)[R], float(&we)[R][V]) {
#pragma unroll
      for (int q = 0; q < R; ++q) {
#pragma unroll
        for (int e = 0; e < V; ++e) we[q][e] = ToF32(reinterpret_cast<const T*>(&raw[q])[e]);
      }
    };
    // kUnroll independent 16-byte loads per row of W in flight per lane before the arithmetic.
    for (; i + (kUnroll - 1) * kStep < k; i += kUnroll * kStep) {
      uint4 raw[kUnroll][R];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int q = 0; q < R; ++q) {
          raw[u][q] = q < rows
                          ? __ldg(reinterpret_cast<const uint4*>(w + (j0 + q) * k + i + u * kStep))
                          : uint4{0, 0, 0, 0};
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float we[R][V];
        widen(raw[u], we);
        step(we, i + u * kStep);
      }
    }
    for (; i < k; i += kStep) {
      uint4 raw[R];
#pragma unroll
      for (int q = 0; q < R; ++q) {
        raw[q] = q < rows ? __ldg(reinterpret_cast<const uint4*>(w + (j0 + q) * k + i))
                          : uint4{0, 0, 0, 0};
      }
      float we[R][V];
      widen(raw, we);
      step(we, i);
    }
  } else {
    for (; i < k; i += kStep) {
      float we[R][V];
#pragma unroll
      for (int q = 0; q < R; ++q) we[q][0] = q < rows ? ToF32(w[(j0 + q) * k + i]) : 0.f;
      step(we, i);
    }
  }
#pragma unroll
  for (int q = 0; q < R; ++q) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (q < rows && r < m) {
        const float s = WarpSum(acc[q][r]);
        if (lane == 0) y[r * ys + j0 + q] = s + (bias ? bias[j0 + q] : 0.f);
      }
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

// How LaunchMatMul runs a decode-sized product on the GEMV built for M rows of x: whether x is
// rounded first (into `scratch`), the x the kernel then reads (p.x, or the rounded rows packed)
// and its row stride, its loads, and its grid. The emulation (tests/kernels/emulated) runs the
// same plan.
struct GemvPlan {
  bool round_first = false;
  const float* x = nullptr;
  int64_t xs = 0;
  bool vec = false, x_vec = false;
  int blocks = 0, threads = 0;
};
template <int M>
__host__ inline GemvPlan PlanGemv(const MatMulParams& p, int64_t xs, void* scratch,
                                  int elem_bytes) {
  auto aligned16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  GemvPlan g;
  g.round_first = GemvRoundsFirst(p);
  g.x = g.round_first ? static_cast<const float*>(scratch) : p.x;
  g.xs = g.round_first ? p.k : xs;
  g.vec = aligned16(p.w) && p.k % (16 / elem_bytes) == 0;
  g.x_vec = g.vec && aligned16(g.x) && g.xs % 4 == 0;
  g.blocks = static_cast<int>((int64_t{p.n} + kRowsPerBlock - 1) / kRowsPerBlock);
  g.threads = 32 * kRowsPerBlock / GemvRowsPerWarp(M);
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
