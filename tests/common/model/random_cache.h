// Random rows and caches for the tests of coded caches and the decode kernels
// (coded_cache_test.cc, tests/kernels/emulated), and a cache's bytes to compare two by.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "common/base/kv_format.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "kernels/backend.h"
#include "kernels/coded_rows.h"

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

// Everything layer 0 of a cache holds for its len tokens, read through `backend`: each head's
// rows (in the dtype), or its code rows of keys and values, its groups' parameters and (fp8)
// scales, and its residual's rows (coded).
inline std::vector<uint8_t> LayerBytes(kernels::KernelBackend& backend, const LayerCache& lc) {
  std::vector<uint8_t> out;
  auto read = [&](const void* p, size_t n) {
    const size_t at = out.size();
    out.resize(at + n);
    EXPECT_TRUE(backend.CopyToHost(out.data() + at, p, n).ok());
  };
  const kernels::KvCoding& c = lc.coding;
  const int d = lc.head_dim;
  const size_t row = lc.row_bytes();
  if (!c.coded()) {
    for (int h = 0; h < lc.n_heads; ++h) {
      for (int t = 0; t < lc.len; ++t) {
        const int64_t at = lc.layout.Row(h, t, d) * static_cast<int64_t>(DTypeSize(lc.dtype));
        read(lc.k + at, row);
        read(lc.v + at, row);
      }
    }
    return out;
  }
  const int coded = c.ResidBegin(lc.len);
  const int kc = CodedKeyRowBytes(c.format, d), vc = CodedValueRowBytes(c.format, d);
  const int groups = coded > 0 ? KvGroups{c.kept}.Of(coded - 1) + 1 : 0;
  for (int h = 0; h < lc.n_heads; ++h) {
    for (int t = 0; t < coded; ++t) {
      read(lc.k + lc.layout.Row(h, t, kc), kc);
      read(lc.v + c.v_layout.Row(h, t, vc), vc);
    }
    read(c.k_params + kernels::KeyParamsAt(c, d, h, 0), groups * KvKeyGroupBytes(c.format, d));
    if (c.format == KvFormat::kFP8) read(c.v_scales + int64_t{h} * c.max_groups, groups);
    read(static_cast<uint8_t*>(c.k_resid) + kernels::ResidAt(c, lc.dtype, d, h, 0),
         (lc.len - coded) * row);
    read(static_cast<uint8_t*>(c.v_resid) + kernels::ResidAt(c, lc.dtype, d, h, 0),
         (lc.len - coded) * row);
  }
  return out;
}

// Whether two caches' bytes (LayerBytes) are the same; if not, where they first differ.
inline ::testing::AssertionResult SameBytes(const std::vector<uint8_t>& got,
                                            const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " bytes, expected " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure() << "byte " << i << " of " << got.size() << " is "
                                           << int{got[i]} << ", expected " << int{want[i]};
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvwire
