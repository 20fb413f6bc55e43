// WindowVotes on the CPU (kernels/selection.h): each output row's columns in blocks that stay
// in L1, every element summed in the reference's order (window rows, then the group's heads),
// the inner loops over columns vectorised.
#include <algorithm>
#include <limits>

#include "kernels/cpu/selection.h"

namespace kvwire::kernels::cpu {

void WindowVotes(const WindowVotesParams& p, const ParallelFn& parallel) {
  constexpr int kBlock = 1024;  // columns: a head's partial votes and the row's result in L1
  const int rows = p.n_heads / p.group;
  const int blocks = (p.prefix + kBlock - 1) / kBlock;
  parallel(int64_t{rows} * blocks, [&](int64_t t0, int64_t t1) {
    float vote[kBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int r = static_cast<int>(t / blocks);
      const int j0 = static_cast<int>(t % blocks) * kBlock;
      const int n = std::min(kBlock, p.prefix - j0);
      float* out = p.votes + int64_t{r} * p.prefix + j0;
      const float init =
          p.reduce == VoteReduce::kMax ? -std::numeric_limits<float>::infinity() : 0.f;
      std::fill(out, out + n, init);
      for (int x = 0; x < p.group; ++x) {
        const int h = r * p.group + x;
        std::fill(vote, vote + n, 0.f);
        for (int i = 0; i < p.window; ++i) {
          const float* row = p.scores + (int64_t{h} * p.window + i) * p.len + j0;
          for (int j = 0; j < n; ++j) vote[j] += row[j];
        }
        if (p.reduce == VoteReduce::kMax) {
          for (int j = 0; j < n; ++j) out[j] = std::max(out[j], vote[j]);
        } else {
          for (int j = 0; j < n; ++j) out[j] += vote[j];
        }
      }
      if (p.reduce == VoteReduce::kMean) {
        for (int j = 0; j < n; ++j) out[j] /= p.group;
      }
    }
  });
}

}  // namespace kvwire::kernels::cpu
