// kernels/cuda/coded_decode.cuh run where no GPU is: compiled as host code over stand-ins for
// CUDA's intrinsics (this folder's kernels/cuda/cuda_util.cuh) and run block by block on
// emulated threads (emulated_block.h), under several scheduling orders, with the launcher's own
// split (SplitFor) and forced ones, the partials merged as decode_attention.cu's MergeChunks
// merges them. Against the reference backend over the same codes, as CodedDecodeBatch checks the
// kernel on a GPU. This catches the kernel's indexing, its units and chunks, its online softmax
// and a barrier missing between a shared write and its reads; not what only a GPU shows (speed,
// the memory model, launch limits).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/kv_format.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "emulated_block.h"
#include "kernels/backend.h"
#include "kernels/cuda/coded_decode.cuh"  // over the stand-in cuda_util.cuh
#include "tests/common/model/random_cache.h"
#include "tests/kernels/ops_test_util.h"

namespace kvwire {
namespace {

namespace cd = kernels::cuda::coded_decode;
using kernels::DecodeAttentionParams;
using kernels::DecodeSequence;

template <typename T, int G>
bool RunGrid(const DecodeAttentionParams& p, cd::Split split, emulated::Order order, float* part_m,
             float* part_l, float* part_acc) {
  const int items = p.batch * p.n_cache_heads;
  for (int y = 0; y < split.chunks; ++y) {
    for (int x = 0; x < items; ++x) {
      const bool ok = emulated::RunBlock(
          cd::kThreads, {static_cast<unsigned>(x), static_cast<unsigned>(y), 0}, order,
          static_cast<uint32_t>(x * 131 + y), [&] {
            cd::CodedDecodeKernel<T, G>(p.seqs, p.n_cache_heads, p.head_dim, p.scale, split.chunks,
                                        split.per, part_m, part_l, part_acc);
          });
      if (!ok) return false;
    }
  }
  return true;
}

// decode_attention.cu's MergeChunks, on the host.
void Merge(const DecodeAttentionParams& p, int chunks, const float* part_m, const float* part_l,
           const float* part_acc) {
  const int d = p.head_dim;
  for (int64_t item = 0; item < int64_t{p.batch} * p.n_heads; ++item) {
    float mx = -INFINITY, sum = 0.f;
    for (int k = 0; k < chunks; ++k) mx = std::fmax(mx, part_m[item * chunks + k]);
    std::vector<float> acc(d, 0.f);
    for (int k = 0; k < chunks; ++k) {
      const float l = part_l[item * chunks + k];
      if (l == 0.f) continue;
      const float w = std::exp(part_m[item * chunks + k] - mx);
      sum += l * w;
      for (int i = 0; i < d; ++i) acc[i] += part_acc[(item * chunks + k) * d + i] * w;
    }
    const DecodeSequence& seq = p.seqs[item / p.n_heads];
    for (int i = 0; i < d; ++i) seq.out[(item % p.n_heads) * d + i] = acc[i] / sum;
  }
}

// The kernel over `p` as LaunchCodedDecode cuts it (or in chunks of `per` units), every block
// emulated; false on a deadlock.
bool Emulate(const DecodeAttentionParams& p, int per, emulated::Order order) {
  cd::Split split = cd::SplitFor(p);
  if (per > 0) {
    const int units = split.per * split.chunks;  // at least the most units of a head
    split.per = per;
    split.chunks = (units + per - 1) / per;
  }
  const int64_t n = int64_t{p.batch} * p.n_heads * split.chunks;
  std::vector<float> scratch(split.chunks > 1 ? n * (2 + p.head_dim) : 0, std::nanf(""));
  float* part_m = split.chunks > 1 ? scratch.data() : nullptr;
  float* part_l = part_m ? part_m + n : nullptr;
  float* part_acc = part_l ? part_l + n : nullptr;
  const int group = p.n_heads / p.n_cache_heads;
  bool ok = false;
  auto by_group = [&]<typename T>() {
    switch (group) {
      case 1:
        return RunGrid<T, 1>(p, split, order, part_m, part_l, part_acc);
      case 2:
        return RunGrid<T, 2>(p, split, order, part_m, part_l, part_acc);
      case 4:
        return RunGrid<T, 4>(p, split, order, part_m, part_l, part_acc);
      default:
        return RunGrid<T, 8>(p, split, order, part_m, part_l, part_acc);
    }
  };
  switch (p.kv_dtype) {
    case DType::kF32:
      ok = by_group.template operator()<float>();
      break;
    case DType::kBF16:
      ok = by_group.template operator()<__nv_bfloat16>();
      break;
    case DType::kF16:
      ok = by_group.template operator()<__half>();
      break;
  }
  if (ok && split.chunks > 1) Merge(p, split.chunks, part_m, part_l, part_acc);
  return ok;
}

struct Seq {
  KvFormat format;
  int kept, appended;
};
struct Case {
  int d, group;
  DType dtype;
  size_t page_bytes;  // 0: caches in host regions
  std::vector<Seq> batch;
};

TEST(CodedDecodeEmulated, EqualsTheReference) {
  constexpr KvFormat kF8 = KvFormat::kFP8, kI8 = KvFormat::kInt8, kI4 = KvFormat::kInt4;
  // Kept lengths around the groups' edges (16 recent tokens, groups of 128), appended ones that
  // fill a group or leave 1 to 127 in the residual; every format in each batch.
  const Case cases[] = {
      {128,
       4,
       DType::kBF16,
       64 << 10,
       {{kI4, 1500, 150}, {kF8, 290, 0}, {kI8, 40, 3}, {kI4, 7, 0}}},
      {64, 8, DType::kF32, 4 << 10, {{kF8, 17, 128}, {kI8, 145, 1}, {kI4, 272, 255}}},
      {256, 1, DType::kF16, 0, {{kI8, 129, 127}, {kI4, 16, 0}, {kF8, 1, 261}}},
      {128, 2, DType::kF32, 8 << 10, {{kI4, 144, 3}, {kF8, 600, 0}, {kI8, 128, 128}}},
      {64, 4, DType::kBF16, 0, {{kF8, 300, 40}, {kI4, 33, 0}, {kI8, 1, 1}}},
  };
  constexpr int kCacheHeads = 2;
  int run = 0;
  for (const Case& cs : cases) {
    SCOPED_TRACE(absl::StrCat("d ", cs.d, " group ", cs.group, " ", DTypeName(cs.dtype),
                              cs.page_bytes ? " paged" : " regions"));
    auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
    ASSERT_TRUE(reference.ok());
    std::unique_ptr<KvPool> pool;
    if (cs.page_bytes > 0) {
      auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 1);
      ASSERT_TRUE(cpu.ok());
      auto made = KvPool::OnBackend(std::move(*cpu), size_t{64} << 20, cs.page_bytes);
      ASSERT_TRUE(made.ok()) << made.status();
      pool = std::move(*made);
    }
    std::mt19937 rng(static_cast<uint32_t>(cs.d * 7 + cs.group));
    const int n_heads = kCacheHeads * cs.group;
    std::vector<std::unique_ptr<KvCache>> caches;
    std::vector<std::vector<float>> qs;
    std::vector<DecodeSequence> seqs;
    for (const Seq& sq : cs.batch) {
      caches.push_back(RandomCache(sq.format, cs.dtype, cs.d, kCacheHeads, sq.kept, sq.appended,
                                   rng(), pool.get(), /*size_every=*/97));
      ASSERT_NE(caches.back(), nullptr);
      LayerCache& lc = caches.back()->layer(0);
      for (int step = 0; step < sq.appended; ++step) {  // coded a group at a time
        const std::vector<float> k = RandomRows(kCacheHeads, cs.d, rng),
                                 v = RandomRows(kCacheHeads, cs.d, rng, 0.5f);
        kernels::KvAppend a{k.data(), v.data(), lc.k, lc.v, lc.layout, lc.coding, sq.kept + step};
        ASSERT_TRUE((*reference)->AppendKv({&a, 1, kCacheHeads, kCacheHeads, cs.d, cs.dtype}).ok());
        lc.len = sq.kept + step + 1;
      }
      qs.push_back(RandomRows(n_heads, cs.d, rng, 0.3f));
      DecodeSequence s;
      s.q = qs.back().data();
      s.k = lc.k;
      s.v = lc.v;
      s.layout = lc.layout;
      s.coding = lc.coding;
      s.len = lc.len;
      seqs.push_back(s);
    }
    DecodeAttentionParams p;
    p.batch = static_cast<int>(seqs.size());
    p.n_heads = n_heads;
    p.n_cache_heads = kCacheHeads;
    p.head_dim = cs.d;
    p.kv_dtype = cs.dtype;
    p.scale = 1.f / std::sqrt(static_cast<float>(cs.d));
    const size_t n = static_cast<size_t>(n_heads) * cs.d;
    std::vector<std::vector<float>> want(seqs.size(), std::vector<float>(n));
    for (size_t b = 0; b < seqs.size(); ++b) seqs[b].out = want[b].data();
    p.seqs = seqs.data();
    ASSERT_TRUE((*reference)->DecodeAttention(p).ok());
    // The launcher's split, a unit per block (some blocks past a head's units), three units a
    // block, and all in one; each under another scheduling order.
    for (int per : {0, 1, 3, 1 << 20}) {
      const emulated::Order order = emulated::kOrders[run++ % std::size(emulated::kOrders)];
      SCOPED_TRACE(absl::StrCat("units per block ", per, ", order ", static_cast<int>(order)));
      std::vector<std::vector<float>> got(seqs.size(), std::vector<float>(n, std::nanf("")));
      for (size_t b = 0; b < seqs.size(); ++b) seqs[b].out = got[b].data();
      ASSERT_TRUE(Emulate(p, per, order)) << "the block's threads deadlocked";
      for (size_t b = 0; b < seqs.size(); ++b) {
        SCOPED_TRACE(absl::StrCat("sequence ", b, " (", KvFormatName(cs.batch[b].format), ")"));
        EXPECT_TRUE(kernels::AllClose(got[b], want[b], kernels::Tolerance{1e-5f, 1e-3f}));
      }
    }
  }
}

}  // namespace
}  // namespace kvwire
