/* PageScores (kernels/selection.h), the kernel (page_scores.cu launches it): what each cache head's
 * sparse selection ranks, one block per (sequence, cache head): hybrid  RocketKV Algorithm 2 lines
 * 3-6: the top-r dimensions by Σ_g |q_g| (each thread ranks one dimension by counting those before
 * it), per query head the page logits over them from the min/max summaries, SparQ-scaled, a softmax
 * over slots, summed; quest   the upper bound per page over every dimension; exact   exact softmax
 * scores per query head over every key (in the dtype, or coded and dequantised as read), summed.
 * Threads take pages (or tokens): a warp reads consecutive pages of one summary row. Logits and
 * exponentials wait in device scratch between the block's reductions. The order of each sum is
 * the reference's except the reductions over pages, which are trees. Tested against the
 * reference by BackendOpsTest.PageScores on cuda and, where no GPU is, in tests/kernels/emulated.
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/cache_rows.cuh"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/ranking.cuh"
#include "kernels/selection.h"

namespace kvwire::kernels::cuda::page_scoring {

constexpr int kThreads = 256;

struct DeviceSegment {
  PageScoreSegment s;
  int64_t scratch = 0;  // floats of the work buffer this segment owns
};

// std::max(a, b) as the host computes it: b only when a < b (a NaN b never wins).
__device__ __forceinline__ float HostMax(float a, float b) { return a < b ? b : a; }

// A block-wide reduction; every thread gets the result.
template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // shared may still be read by a previous reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T out = shared[0];
  for (int w = 1; w < static_cast<int>(blockDim.x) / 32; ++w) out = op(out, shared[w]);
  return out;
}

template <typename T>
__device__ void Hybrid(const PageScoreSegment& s, int d, float* u, float* sh) {
  __shared__ float red[32];
  const SummaryLayout& l = s.layout;
  const int group = s.group, r = min(s.top_r, d), n_pages = l.pages(s.len);
  const T* block = static_cast<const T*>(s.summaries);
  float* a = sh;
  float* sum = a + d;
  int* dims = reinterpret_cast<int*>(sum + d);
  float* inv_scale = reinterpret_cast<float*>(dims + d);
  float* mx = inv_scale + group;
  float* inv_z = mx + group;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float aa = 0.f, ss = 0.f;
    for (int g = 0; g < group; ++g) {
      aa += fabsf(s.q[g * d + i]);
      ss += s.q[g * d + i];
    }
    a[i] = aa;
    sum[i] = ss;
  }
  __syncthreads();
  // Line 3: dimension i's place among the d in the ranking order; the first r are kept.
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const uint64_t key = BestFirstKey(a[i], i);
    int rank = 0;
    for (int j = 0; j < d; ++j) rank += BestFirstKey(a[j], j) > key;
    if (rank < r) dims[rank] = i;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < group; g += blockDim.x) {
    const float* q = s.q + g * d;
    float num = 0.f, den = 0.f;
    for (int x = 0; x < r; ++x) num += fabsf(q[dims[x]]);
    for (int i = 0; i < d; ++i) den += fabsf(q[i]);
    inv_scale[g] = den > 0.f && num > 0.f ? 1.f / sqrtf(d * num / den) : 1.f;
  }
  __syncthreads();
  // Lines 4-6: each query head's page logits and their max.
  for (int g = 0; g < group; ++g) {
    const float* q = s.q + g * d;
    float local = -INFINITY;
    for (int p = threadIdx.x; p < n_pages; p += blockDim.x) {
      float acc = 0.f;
      for (int x = 0; x < r; ++x) {
        const int dim = dims[x];
        acc = fmaf(q[dim], ToF32(block[l.Offset(sum[dim] >= 0.f, dim, p)]), acc);
      }
      const float y = acc * inv_scale[g];
      u[static_cast<int64_t>(g) * n_pages + p] = y;
      local = HostMax(local, y);
    }
    const float m = BlockReduce(
        local, [](float x, float y) { return HostMax(x, y); }, red);
    if (threadIdx.x == 0) mx[g] = m;
  }
  __syncthreads();
  // A softmax per head over slots: every page but the last holds `page` slots.
  const int last_slots = s.len - (n_pages - 1) * l.page;
  for (int g = 0; g < group; ++g) {
    float local = 0.f;
    for (int p = threadIdx.x; p < n_pages; p += blockDim.x) {
      float* up = u + static_cast<int64_t>(g) * n_pages + p;
      *up = expf(*up - mx[g]);
      local += *up;
    }
    const float z = BlockReduce(
        local, [](float x, float y) { return x + y; }, red);
    __syncthreads();  // the last page's exponential, written by another thread
    if (threadIdx.x == 0) {
      const float last = u[static_cast<int64_t>(g) * n_pages + n_pages - 1];
      inv_z[g] = 1.f / (z * l.page - last * static_cast<float>(l.page - last_slots));
    }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n_pages; p += blockDim.x) {
    float acc = 0.f;
    for (int g = 0; g < group; ++g)
      acc = fmaf(inv_z[g], u[static_cast<int64_t>(g) * n_pages + p], acc);
    s.score[p] = acc;
  }
}

template <typename T>
__device__ void Quest(const PageScoreSegment& s, int d) {
  const SummaryLayout& l = s.layout;
  const T* block = static_cast<const T*>(s.summaries);
  for (int p = threadIdx.x; p < l.pages(s.len); p += blockDim.x) {
    float bound = 0.f;
    for (int i = 0; i < d; ++i) {
      for (int g = 0; g < s.group; ++g) {
        const float w = s.q[g * d + i];
        bound = fmaf(w, ToF32(block[l.Offset(w >= 0.f, i, p)]), bound);
      }
    }
    s.score[p] = bound;
  }
}

template <typename T>
__device__ void Exact(const PageScoreSegment& s, int d, float* e) {
  __shared__ float red[32];
  __shared__ double red_d[32];
  for (int t = threadIdx.x; t < s.len; t += blockDim.x) s.score[t] = 0.f;
  for (int g = 0; g < s.group; ++g) {
    const float* q = s.q + g * d;
    float local = -INFINITY;
    WithRows<T>(s.k, nullptr, s.kv, s.coding, d, s.len, [&](const auto& rows) {
      for (int t = threadIdx.x; t < s.len; t += blockDim.x) {
        const auto row = rows.At(s.head, t);
        float dot = 0.f;
        for (int i = 0; i < d; ++i) dot += q[i] * row.key(i);
        e[t] = dot * s.scale;
        local = HostMax(local, e[t]);
      }
    });
    const float mx = BlockReduce(
        local, [](float x, float y) { return HostMax(x, y); }, red);
    double part = 0;
    for (int t = threadIdx.x; t < s.len; t += blockDim.x) {
      e[t] = expf(e[t] - mx);
      part += e[t];
    }
    const double z = BlockReduce(
        part, [](double x, double y) { return x + y; }, red_d);
    for (int t = threadIdx.x; t < s.len; t += blockDim.x) {
      s.score[t] += static_cast<float>(e[t] / z);
    }
  }
}

template <typename T>
__global__ void PageScoresKernel(const DeviceSegment* segs, int d, float* work) {
  float* sh = DynamicShared<float>();
  const DeviceSegment& ds = segs[blockIdx.x];
  switch (ds.s.kind) {
    case PageScoreKind::kHybrid:
      Hybrid<T>(ds.s, d, work + ds.scratch, sh);
      break;
    case PageScoreKind::kQuest:
      Quest<T>(ds.s, d);
      break;
    case PageScoreKind::kExact:
      Exact<T>(ds.s, d, work + ds.scratch);
      break;
  }
}

// The launch's plan: each segment's table entry (its offset in the work buffer), the work
// buffer's floats, and the dynamic shared memory a block needs.
struct Plan {
  std::vector<DeviceSegment> segs;
  int64_t work = 0;
  int max_group = 1;  // query heads per cache head, at the most
  size_t shared = 0;
};
__host__ inline Plan PlanFor(const PageScoresParams& p) {
  Plan plan;
  plan.segs.resize(p.count);
  for (int i = 0; i < p.count; ++i) {
    const PageScoreSegment& s = p.segs[i];
    plan.segs[i].s = s;
    plan.segs[i].scratch = plan.work;
    plan.max_group = std::max(plan.max_group, s.group);
    if (s.kind == PageScoreKind::kHybrid) plan.work += int64_t{s.group} * s.layout.pages(s.len);
    if (s.kind == PageScoreKind::kExact) plan.work += s.len;
  }
  plan.shared = sizeof(float) * (3 * size_t{static_cast<unsigned>(p.head_dim)} +
                                 3 * size_t{static_cast<unsigned>(plan.max_group)});
  return plan;
}

}  // namespace kvwire::kernels::cuda::page_scoring
