// TopK on the CPU (kernels/selection.h): partial selection in the ranking order
// (common/base/ranking.h's BestFirstPrefix) rather than a sort of every item.
#include <algorithm>
#include <numeric>
#include <vector>

#include "common/base/ranking.h"
#include "kernels/cpu/selection.h"

namespace kvwire::kernels::cpu {

void TakeBest(const float* score, int run, int n, int k, bool ascending, int32_t* out) {
  const int n_runs = (n + run - 1) / run;
  // Only the best runs are needed: ceil(k/run) of them, one more for a short last run.
  // Thread-local: this runs per head and step on the model's threads.
  thread_local std::vector<int32_t> order;
  BestFirstPrefix(score, n_runs, (k + run - 1) / run + 1, &order);
  int taken = 0;
  for (size_t i = 0; taken < k; ++i) {
    if (i == order.size()) {  // more short runs than expected: rank them all
      BestFirstPrefix(score, n_runs, n_runs, &order);
    }
    const int r = order[i];
    for (int t = r * run; t < std::min(n, (r + 1) * run) && taken < k; ++t) out[taken++] = t;
  }
  if (ascending) std::sort(out, out + k);
}

namespace {

// With tie scores: the k best by (score, tie, index), as TopKAscending ranks.
void TakeBestWithTie(const TopKSegment& s, bool ascending) {
  thread_local std::vector<int32_t> idx;
  idx.resize(s.n);
  std::iota(idx.begin(), idx.end(), 0);
  const BestFirst<float> before{s.score, s.tie};
  std::nth_element(idx.begin(), idx.begin() + (s.k - 1), idx.end(), before);
  if (ascending) {
    std::sort(idx.begin(), idx.begin() + s.k);
  } else {
    std::sort(idx.begin(), idx.begin() + s.k, before);
  }
  std::copy(idx.begin(), idx.begin() + s.k, s.out);
}

}  // namespace

void TopK(const TopKParams& p, const ParallelFn& parallel) {
  parallel(p.count, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const TopKSegment& s = p.segs[i];
      if (s.tie != nullptr) {
        TakeBestWithTie(s, p.ascending);
      } else {
        TakeBest(s.score, s.run, s.n, s.k, p.ascending, s.out);
      }
      for (int j = 0; j < s.append; ++j) s.out[s.k + j] = s.n + j;
    }
  });
}

}  // namespace kvwire::kernels::cpu
