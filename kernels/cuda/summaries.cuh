/* UpdateSummaries' kernel (summaries.cu launches it): RocketKV's page min/max summaries brought
 * up to date after tokens were appended. A block per (segment, cache head), a thread per (page,
 * dimension) of the pages holding new tokens: min and max over the page's slots, stored in the
 * cache dtype (exact: they are values of it; a coded cache's keys are dequantised, and their
 * extremes rounded to it). Tested against the reference by
 * BackendOpsTest.UpdateSummariesRecomputesThePagesOfNewTokens and CodedCacheTest.* on cuda and,
 * where no GPU is, in tests/kernels/emulated. */
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cuda/cache_rows.cuh"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/selection.h"

namespace kvwire::kernels::cuda::summary_update {

constexpr int kThreads = 128;

struct HeadItem {
  SummaryUpdateSegment s;
  int head = 0;
};

template <typename T>
__global__ void UpdateSummariesKernel(const HeadItem* items) {
  const HeadItem& item = items[blockIdx.x];
  const SummaryUpdateSegment& s = item.s;
  const SummaryLayout& l = s.layout;
  const int first_page = s.first / l.page;
  const int64_t work = static_cast<int64_t>(l.pages(s.len) - first_page) * l.head_dim;
  T* block = static_cast<T*>(s.summaries) + item.head * l.head_elems();
  WithRows<T>(s.k, nullptr, s.kv, s.coding, l.head_dim, s.len, [&](const auto& rows) {
    for (int64_t w = threadIdx.x; w < work; w += blockDim.x) {
      const int page = first_page + static_cast<int>(w / l.head_dim);
      const int d = static_cast<int>(w % l.head_dim);
      float lo = INFINITY, hi = -INFINITY;
      const int end = min(s.len, (page + 1) * l.page);
      for (int t = page * l.page; t < end; ++t) {
        const float v = rows.At(item.head, t).key(d);
        // As the reference's std::min and std::max: fminf and fmaxf may pick either zero.
        lo = v < lo ? v : lo;
        hi = hi < v ? v : hi;
      }
      block[l.Offset(false, d, page)] = FromF32<T>(lo);
      if (l.sets() == 2) block[l.Offset(true, d, page)] = FromF32<T>(hi);
    }
  });
}

// The launch's items: a (segment, cache head) for each head of a segment with new tokens.
__host__ inline std::vector<HeadItem> ItemsFor(const UpdateSummariesParams& p) {
  std::vector<HeadItem> items;
  for (int i = 0; i < p.count; ++i) {
    const SummaryUpdateSegment& s = p.segs[i];
    if (s.first == s.len) continue;
    for (int c = 0; c < s.n_heads; ++c) items.push_back({s, c});
  }
  return items;
}

}  // namespace kvwire::kernels::cuda::summary_update
