// GatherKv on the CPU (kernels/selection.h): each kept row converted to the cache dtype whole,
// cache heads in parallel.
#include "kernels/cpu/selection.h"

namespace kvwire::kernels::cpu {

void GatherKv(const GatherKvParams& p, const ParallelFn& parallel) {
  const int per_kv = p.n_cache_heads / p.n_kv_heads;
  const size_t row = static_cast<size_t>(p.head_dim) * DTypeSize(p.dtype);
  parallel(p.n_cache_heads, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g = (c / per_kv) * p.head_dim;
      for (int t = 0; t < p.count; ++t) {
        const int64_t tok = p.kept[c * p.count + t];
        const size_t dst = (static_cast<size_t>(c) * p.count + t) * row;
        FromFloat(p.dtype, p.k + tok * p.kv_stride + g, static_cast<uint8_t*>(p.k_out) + dst,
                  p.head_dim);
        FromFloat(p.dtype, p.v + tok * p.kv_stride + g, static_cast<uint8_t*>(p.v_out) + dst,
                  p.head_dim);
      }
    }
  });
}

}  // namespace kvwire::kernels::cpu
