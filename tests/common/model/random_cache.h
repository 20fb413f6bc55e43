// Random rows and coded caches for the tests of coded caches and their kernels
// (coded_cache_test.cc, tests/kernels/emulated).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "common/base/kv_format.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"

namespace kvwire {

// n rows of d normal values with one large channel, as RoPE'd keys have. With size_every > 0
// the rows' size doubles and halves every size_every rows, so that key groups' parameters and
// fp8 value groups' scales differ from group to group.
inline std::vector<float> RandomRows(int n, int d, std::mt19937& rng, float scale = 1.f,
                                     int size_every = 0) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> x(static_cast<size_t>(n) * d);
  for (size_t i = 0; i < x.size(); ++i) {
    const bool doubled = size_every > 0 && i / d / size_every % 2 == 1;
    x[i] = (dist(rng) + (i % d == 3 ? 8.f : 0.f)) * (doubled ? 2.f : 1.f);
  }
  return x;
}

// A cache of `heads` heads keeping `kept` random tokens of `d` values in `dtype`, coded in `f`
// (or in the dtype: kAuto), with room for `appended` more: in host memory, or in the pages of
// `pool`. The same seed, the same rows and codes.
inline std::unique_ptr<KvCache> RandomCache(KvFormat f, DType dtype, int d, int heads, int kept,
                                            int appended, uint32_t seed, KvPool* pool,
                                            int size_every = 0) {
  KvCacheShape shape;
  shape.n_heads = heads;
  shape.head_dim = d;
  shape.dtype = dtype;
  shape.capacity = {kept + appended};
  shape.format = f;
  shape.appended = appended;
  auto cache =
      pool ? KvCache::CreatePaged(shape, *pool) : KvCache::Create(shape, HeapKvAllocator());
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return nullptr;
  LayerCache& lc = (*cache)->layer(0);
  if (KvCoded(f)) lc.coding.kept = kept;
  std::mt19937 rng(seed);
  const size_t row = d * DTypeSize(dtype);
  for (int h = 0; h < heads; ++h) {
    std::vector<uint8_t> k(kept * row), v(kept * row);
    const std::vector<float> kf = RandomRows(kept, d, rng, 1.f, size_every),
                             vf = RandomRows(kept, d, rng, 0.5f, size_every);
    FromFloat(dtype, kf.data(), k.data(), kf.size());
    FromFloat(dtype, vf.data(), v.data(), vf.size());
    for (int t = 0; t < kept; ++t) lc.positions[h * lc.capacity + t] = t;
    if (!KvCoded(f)) {
      EXPECT_TRUE((*cache)->WriteRows(0, h, 0, kept, k.data(), v.data()).ok());
      continue;
    }
    std::vector<uint8_t> kb(KvKeyBlockBytes(f, dtype, d, kept, 0, kept));
    std::vector<uint8_t> vb(KvValueBlockBytes(f, dtype, d, kept, 0, kept));
    EncodeKvKeys(f, dtype, d, kept, 0, kept, k.data(), kb.data());
    EncodeKvValues(f, dtype, d, kept, 0, kept, v.data(), vb.data());
    EXPECT_TRUE((*cache)->WriteCodedBlock(0, h, 0, kept, kb.data(), vb.data()).ok());
  }
  lc.len = kept;
  return std::move(*cache);
}

}  // namespace kvwire
