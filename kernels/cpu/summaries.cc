// UpdateSummaries on the CPU (kernels/selection.h): each page holding new tokens recomputed
// from its slots, a row at a time; cache heads in parallel.
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/coded_rows.h"
#include "kernels/cpu/selection.h"

namespace kvwire::kernels::cpu {

void UpdateHeadSummaries(const SummaryUpdateSegment& s, int head) {
  const SummaryLayout& l = s.layout;
  const int d = l.head_dim;
  const size_t es = DTypeSize(l.dtype);
  thread_local std::vector<float> lo, hi, row;
  lo.resize(d);
  hi.resize(d);
  row.resize(d);
  const auto* k = static_cast<const uint8_t*>(s.k);
  auto* block = static_cast<uint8_t*>(s.summaries) + head * l.head_elems() * es;
  for (int p = s.first / l.page; p < l.pages(s.len); ++p) {
    std::fill(lo.begin(), lo.end(), std::numeric_limits<float>::infinity());
    std::fill(hi.begin(), hi.end(), -std::numeric_limits<float>::infinity());
    for (int t = p * l.page; t < std::min(s.len, (p + 1) * l.page); ++t) {
      if (s.coding.coded()) {
        CodedKeyRow(k, s.kv, s.coding, l.dtype, d, s.len, head, t, row.data());
      } else {
        ToFloat(l.dtype, k + s.kv.Row(head, t, d) * static_cast<int64_t>(es), row.data(), d);
      }
      for (int i = 0; i < d; ++i) {
        lo[i] = std::min(lo[i], row[i]);
        hi[i] = std::max(hi[i], row[i]);
      }
    }
    // Min and max of values in the cache dtype are exact in it: they are stored so.
    for (int i = 0; i < d; ++i) {
      FromFloat(l.dtype, &lo[i], block + l.Offset(false, i, p) * es, 1);
      if (l.sets() == 2) FromFloat(l.dtype, &hi[i], block + l.Offset(true, i, p) * es, 1);
    }
  }
}

void UpdateSummaries(const UpdateSummariesParams& p, const ParallelFn& parallel) {
  std::vector<std::pair<int, int>> heads;  // (segment, head)
  for (int i = 0; i < p.count; ++i) {
    for (int c = 0; c < p.segs[i].n_heads; ++c) heads.emplace_back(i, c);
  }
  parallel(static_cast<int64_t>(heads.size()), [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) UpdateHeadSummaries(p.segs[heads[h].first], heads[h].second);
  });
}

}  // namespace kvwire::kernels::cpu
