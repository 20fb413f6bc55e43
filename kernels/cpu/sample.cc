// Sample on the CPU (kernels/selection.h): kernels/sampling.h's partial-sort sampler per row,
// rows in parallel.
#include "kernels/cpu/selection.h"

namespace kvwire::kernels::cpu {

void Sample(const SampleParams& p, const ParallelFn& parallel) {
  const int64_t stride = p.stride ? p.stride : p.vocab;
  parallel(p.batch, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      p.out[b] =
          kernels::Sample(p.logits + b * stride, p.vocab, p.rows[b].params, p.rows[b].uniform);
    }
  });
}

}  // namespace kvwire::kernels::cpu
