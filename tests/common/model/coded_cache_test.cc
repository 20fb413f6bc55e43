// A cache kept in the wire's codes (KvCacheShape::format fp8, int8, int4): the wire's blocks
// stored as they arrive, decode attention and sparse selection (page summaries, exact scores)
// dequantising as they read, tokens appended into the residual and coded a group at a time. The
// specification is a float32 cache holding what the codes decode to: the reference backend over the
// coded cache must equal the reference over that cache exactly, and the CPU kernel must match the
// reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/kv_format.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "kernels/backend.h"
#include "kernels/coded_rows.h"
#include "tests/common/model/random_cache.h"
#include "tests/kernels/cuda_kernels_util.h"
#include "tests/kernels/ops_test_util.h"
#if KVWIRE_HAS_CUDA
#include "kernels/cuda/coded_decode.h"
#endif

namespace kvwire {
namespace {

using kernels::DecodeAttentionParams;
using kernels::DecodeSequence;
using kernels::KvAppend;

// Appended: two groups coded and 122 tokens in the residual, so that a length runs well past
// the rows in pages (a page table sized for the length would be read past its end).
constexpr int kHeads = 2, kGroup = 2, kKept = 300, kAppended = 378;
// The CPU kernel sums q·a + (q∘b)·codes where the reference sums q·(a + b·codes).
constexpr kernels::Tolerance kTolerance{1e-5f, 1e-3f};

// The float32 rows a block of `rows` (in `dtype`) decodes to.
std::vector<float> Decoded(KvFormat f, DType dtype, int d, const std::vector<uint8_t>& rows,
                           int kept, bool keys) {
  std::vector<uint8_t> block(keys ? KvKeyBlockBytes(f, dtype, d, kept, 0, kept)
                                  : KvValueBlockBytes(f, dtype, d, kept, 0, kept));
  std::vector<float> back(static_cast<size_t>(kept) * d);
  if (keys) {
    EncodeKvKeys(f, dtype, d, kept, 0, kept, rows.data(), block.data());
    DecodeKvKeys(f, DType::kF32, d, kept, 0, kept, block.data(), back.data());
  } else {
    EncodeKvValues(f, dtype, d, kept, 0, kept, rows.data(), block.data());
    DecodeKvValues(f, DType::kF32, d, kept, 0, kept, block.data(), back.data());
  }
  return back;
}

class CodedCacheTest : public ::testing::TestWithParam<std::tuple<KvFormat, DType, int>> {
 protected:
  int dim() const { return std::get<2>(GetParam()); }
  KvFormat format() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }

  KvCacheShape Shape(KvFormat f, DType t) const {
    KvCacheShape s;
    s.n_heads = kHeads;
    s.head_dim = dim();
    s.dtype = t;
    s.capacity = {kKept + kAppended};
    s.format = f;
    s.appended = kAppended;
    return s;
  }

  // A coded cache holding `keys` and `values` ([head][kept][d] in dtype) as the wire would
  // deliver them, cut into blocks at `cut`: in host memory, or in the pages of `pool`.
  std::unique_ptr<KvCache> CodedCache(const std::vector<uint8_t>& keys,
                                      const std::vector<uint8_t>& values, int cut,
                                      KvPool* pool = nullptr) {
    auto cache = pool ? KvCache::CreatePaged(Shape(format(), dtype()), *pool)
                      : KvCache::Create(Shape(format(), dtype()), HeapKvAllocator());
    EXPECT_TRUE(cache.ok()) << cache.status();
    LayerCache& lc = (*cache)->layer(0);
    lc.coding.kept = kKept;
    const size_t row = dim() * DTypeSize(dtype());
    for (int h = 0; h < kHeads; ++h) {
      const uint8_t* k = keys.data() + h * kKept * row;
      const uint8_t* v = values.data() + h * kKept * row;
      for (auto [first, n] : {std::pair{0, cut}, std::pair{cut, kKept - cut}}) {
        std::vector<uint8_t> kb(KvKeyBlockBytes(format(), dtype(), dim(), kKept, first, n));
        std::vector<uint8_t> vb(KvValueBlockBytes(format(), dtype(), dim(), kKept, first, n));
        EncodeKvKeys(format(), dtype(), dim(), kKept, first, n, k, kb.data());
        EncodeKvValues(format(), dtype(), dim(), kKept, first, n, v, vb.data());
        EXPECT_TRUE((*cache)->WriteCodedBlock(0, h, first, n, kb.data(), vb.data()).ok());
      }
      for (int t = 0; t < kKept; ++t) lc.positions[h * lc.capacity + t] = t;
    }
    lc.len = kKept;
    return std::move(*cache);
  }

  // The specification of CodedCache(keys, values): a float32 cache of what the codes decode to.
  std::unique_ptr<KvCache> PlainCache(const std::vector<uint8_t>& keys,
                                      const std::vector<uint8_t>& values) {
    auto plain = KvCache::Create(Shape(KvFormat::kAuto, DType::kF32), HeapKvAllocator());
    EXPECT_TRUE(plain.ok()) << plain.status();
    LayerCache& pc = (*plain)->layer(0);
    const size_t row = dim() * DTypeSize(dtype());
    for (int h = 0; h < kHeads; ++h) {
      const std::vector<uint8_t> k(keys.begin() + h * kKept * row,
                                   keys.begin() + (h + 1) * kKept * row);
      const std::vector<uint8_t> v(values.begin() + h * kKept * row,
                                   values.begin() + (h + 1) * kKept * row);
      const std::vector<float> kf = Decoded(format(), dtype(), dim(), k, kKept, true);
      const std::vector<float> vf = Decoded(format(), dtype(), dim(), v, kKept, false);
      for (int t = 0; t < kKept; ++t) {
        std::memcpy(pc.k_row(h, t), &kf[t * dim()], dim() * 4);
        std::memcpy(pc.v_row(h, t), &vf[t * dim()], dim() * 4);
      }
    }
    pc.len = kKept;
    return std::move(*plain);
  }

  // Attention of kHeads · kGroup query heads `q` over layer 0 of `cache` (all tokens, or
  // `indices` per cache head), with probabilities; the buffers in the backend's memory.
  // The outputs, then (with_probs) the probabilities: without them a CUDA backend splits the
  // attended tokens over warps (split-KV), with them it attends each head in one pass.
  std::vector<float> Attend(kernels::KernelBackend& backend, const KvCache& cache,
                            const std::vector<float>& q, const std::vector<int32_t>* indices,
                            int num_indices, bool with_probs = true) {
    const LayerCache& lc = cache.layer(0);
    kernels::Arena arena(backend);
    const size_t n_probs = with_probs ? static_cast<size_t>(kHeads) * kGroup * lc.len : 0;
    DecodeSequence s;
    s.q = arena.Upload(q);
    float* out = arena.Zeros(q.size());
    float* probs = arena.Zeros(n_probs);
    s.out = out;
    s.k = lc.k;
    s.v = lc.v;
    s.layout = lc.layout;
    s.coding = lc.coding;
    s.len = lc.len;
    s.probs = with_probs ? probs : nullptr;
    if (indices) {
      s.indices = arena.Upload(*indices);
      s.num_indices = num_indices;
    }
    DecodeAttentionParams p;
    p.seqs = &s;
    p.batch = 1;
    p.n_heads = kHeads * kGroup;
    p.n_cache_heads = kHeads;
    p.head_dim = dim();
    p.kv_dtype = lc.dtype;
    p.scale = 0.125f;
    const absl::Status st = backend.DecodeAttention(p);
    EXPECT_TRUE(st.ok()) << st;
    std::vector<float> got = arena.Download(out, q.size());
    const std::vector<float> got_probs = arena.Download(probs, n_probs);
    got.insert(got.end(), got_probs.begin(), got_probs.end());
    return got;
  }

  // Sparse decode's reads of layer 0: page summaries (min and max per channel of pages of 16)
  // and exact scores of query heads `q` for cache head 1, as floats.
  std::vector<float> Selection(kernels::KernelBackend& backend, const KvCache& cache,
                               const std::vector<float>& q) {
    const LayerCache& lc = cache.layer(0);
    kernels::Arena arena(backend);
    kernels::SummaryLayout layout{dim(), 16, 1 << 30, (lc.capacity + 15) / 16, lc.dtype};
    const size_t sum_bytes = kHeads * layout.head_elems() * DTypeSize(lc.dtype);
    uint8_t* sums = arena.Filled<uint8_t>(sum_bytes, 0);
    kernels::SummaryUpdateSegment u;
    u.k = lc.k;
    u.kv = lc.layout;
    u.coding = lc.coding;
    u.n_heads = kHeads;
    u.len = lc.len;
    u.summaries = sums;
    u.layout = layout;
    EXPECT_TRUE(backend.UpdateSummaries({&u, 1}).ok());
    const std::vector<uint8_t> sum_rows = arena.DownloadBytes(sums, sum_bytes);
    std::vector<float> out(sum_bytes / DTypeSize(lc.dtype));
    ToFloat(lc.dtype, sum_rows.data(), out.data(), out.size());
    float* score = arena.Zeros(lc.len);
    kernels::PageScoreSegment e;
    e.kind = kernels::PageScoreKind::kExact;
    e.q = arena.Upload(std::vector<float>(q.begin() + kGroup * dim(), q.end()));
    e.group = kGroup;
    e.len = lc.len;
    e.k = lc.k;
    e.kv = lc.layout;
    e.coding = lc.coding;
    e.head = 1;
    e.scale = 0.125f;
    e.score = score;
    const absl::Status st = backend.PageScores({&e, 1, dim(), lc.dtype});
    EXPECT_TRUE(st.ok()) << st;
    const std::vector<float> scores = arena.Download(score, lc.len);
    out.insert(out.end(), scores.begin(), scores.end());
    return out;
  }

  // The keys and values of kHeads heads of kKept tokens in dtype(), [head][kept][d].
  void RandomHeads(std::mt19937& rng, std::vector<uint8_t>* keys, std::vector<uint8_t>* values) {
    const size_t row = dim() * DTypeSize(dtype());
    keys->assign(kHeads * kKept * row, 0);
    values->assign(kHeads * kKept * row, 0);
    for (int h = 0; h < kHeads; ++h) {
      const std::vector<float> k = RandomRows(kKept, dim(), rng),
                               v = RandomRows(kKept, dim(), rng, 0.5f);
      FromFloat(dtype(), k.data(), keys->data() + h * kKept * row, k.size());
      FromFloat(dtype(), v.data(), values->data() + h * kKept * row, v.size());
    }
  }
};

TEST_P(CodedCacheTest, DecodeReadsAndAppendsAsTheSpecification) {
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 2);
  ASSERT_TRUE(reference.ok() && cpu.ok());
  std::mt19937 rng(11);
  const size_t row = dim() * DTypeSize(dtype());
  std::vector<uint8_t> keys, values;
  RandomHeads(rng, &keys, &values);
  // One cache per backend (appends write them), cut differently: the codes are the same.
  std::unique_ptr<KvCache> on_ref = CodedCache(keys, values, 50);
  std::unique_ptr<KvCache> on_cpu = CodedCache(keys, values, 290);
  // The specification: a float32 cache of what the codes decode to.
  std::unique_ptr<KvCache> plain = PlainCache(keys, values);
  LayerCache& pc = plain->layer(0);
  // Decode appends kAppended tokens: two groups fill and are coded, 122 stay in the residual.
  std::vector<std::vector<uint8_t>> resid_k(kHeads), resid_v(kHeads);
  for (int step = 0; step <= kAppended; ++step) {
    SCOPED_TRACE(absl::StrCat("after ", step, " appended"));
    const std::vector<float> q = RandomRows(kHeads * kGroup, dim(), rng, 0.3f);
    const std::vector<float> want = Attend(**reference, *plain, q, nullptr, 0);
    ASSERT_EQ(Attend(**reference, *on_ref, q, nullptr, 0), want);
    const std::vector<float> got = Attend(**cpu, *on_cpu, q, nullptr, 0);
    ASSERT_TRUE(kernels::AllClose(got, want, kTolerance));
    if (step % 64 == 0 || step == kAppended) {  // what sparse selection reads
      const std::vector<float> sel = Selection(**reference, *on_ref, q);
      ASSERT_TRUE(kernels::AllClose(Selection(**cpu, *on_cpu, q), sel, kTolerance));
      if (dtype() == DType::kF32) {  // (summaries are kept in the cache dtype)
        ASSERT_TRUE(kernels::AllClose(sel, Selection(**reference, *plain, q), kTolerance));
      }
    }
    if (step % 37 == 0) {  // a sparse selection, in any order
      const int n = 40;
      std::vector<int32_t> idx(kHeads * n);
      for (int32_t& i : idx) i = static_cast<int32_t>(rng() % pc.len);
      ASSERT_EQ(Attend(**reference, *on_ref, q, &idx, n), Attend(**reference, *plain, q, &idx, n));
      ASSERT_TRUE(kernels::AllClose(Attend(**cpu, *on_cpu, q, &idx, n),
                                    Attend(**reference, *plain, q, &idx, n), kTolerance));
      // In order (as the selections give them): runs within a key group, which the CPU kernel
      // takes in blocks of rows.
      for (int h = 0; h < kHeads; ++h) std::sort(idx.begin() + h * n, idx.begin() + (h + 1) * n);
      ASSERT_TRUE(kernels::AllClose(Attend(**cpu, *on_cpu, q, &idx, n),
                                    Attend(**reference, *plain, q, &idx, n), kTolerance));
    }
    if (step == kAppended) break;
    // Token t: into each coded cache through its backend, into the specification by hand.
    const int t = kKept + step;
    const std::vector<float> k = RandomRows(kHeads, dim(), rng),
                             v = RandomRows(kHeads, dim(), rng, 0.5f);
    for (auto [backend, cache] :
         {std::pair{reference->get(), on_ref.get()}, std::pair{cpu->get(), on_cpu.get()}}) {
      LayerCache& lc = cache->layer(0);
      KvAppend a{k.data(), v.data(), lc.k, lc.v, lc.layout, lc.coding, t};
      const absl::Status st = backend->AppendKv({&a, 1, kHeads, kHeads, dim(), dtype()});
      ASSERT_TRUE(st.ok()) << st;
      lc.len = t + 1;
    }
    for (int h = 0; h < kHeads; ++h) {
      // A token in the residual is its row in the cache dtype.
      std::vector<uint8_t> kr(row), vr(row);
      FromFloat(dtype(), k.data() + h * dim(), kr.data(), dim());
      FromFloat(dtype(), v.data() + h * dim(), vr.data(), dim());
      ToFloat(dtype(), kr.data(), reinterpret_cast<float*>(pc.k_row(h, t)), dim());
      ToFloat(dtype(), vr.data(), reinterpret_cast<float*>(pc.v_row(h, t)), dim());
      resid_k[h].insert(resid_k[h].end(), kr.begin(), kr.end());
      resid_v[h].insert(resid_v[h].end(), vr.begin(), vr.end());
      if (resid_k[h].size() < kKeyGroupTokens * row) continue;
      // A whole group: its rows are what the group's codes decode to.
      const int first = t + 1 - kKeyGroupTokens;
      std::vector<uint8_t> codes(kKeyGroupTokens * row), params(4 * dim());
      uint8_t scale = 0;
      std::vector<float> x(dim());
      const size_t kc = KvKeyCodeBytes(format(), dtype(), dim());
      const size_t vc = KvValueRowBytes(format(), dtype(), dim());
      EncodeKeyGroup(format(), dtype(), dim(), kKeyGroupTokens, resid_k[h].data(), codes.data(),
                     params.data());
      for (int i = 0; i < kKeyGroupTokens; ++i) {
        DecodeKeyRow(format(), dim(), codes.data() + i * kc, params.data(),
                     reinterpret_cast<float*>(pc.k_row(h, first + i)));
      }
      EncodeValueGroup(format(), dtype(), dim(), kKeyGroupTokens, resid_v[h].data(), codes.data(),
                       &scale);
      for (int i = 0; i < kKeyGroupTokens; ++i) {
        DecodeValueRow(format(), dim(), codes.data() + i * vc, scale,
                       reinterpret_cast<float*>(pc.v_row(h, first + i)));
      }
      resid_k[h].clear();
      resid_v[h].clear();
    }
    pc.len = t + 1;
  }
  EXPECT_EQ(on_ref->layer(0).coding.ResidBegin(kKept + kAppended), kKept + 256);
}

// The CPU kernels' error against the specification over many draws of keys, values and queries,
// dense and sparse (in any order and sorted), with queries scaled so that attention is spread
// (0.3) or peaked (2), where DecodeReadsAndAppendsAsTheSpecification draws once. int4's integer
// products (kernels/cpu/decode_coded.cc) once summed their bytes in int32, which held their fixed
// point to 2^19 over heads of 256: they passed that test and failed here (1.9 of the tolerance).
TEST_P(CodedCacheTest, AttendsAsTheSpecificationOverManyDraws) {
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 2);
  ASSERT_TRUE(reference.ok() && cpu.ok());
  constexpr int kDraws = 24, kSelected = 40;
  double worst = 0;
  std::string worst_at;
  for (int draw = 0; draw < kDraws; ++draw) {
    std::mt19937 rng(1000 + draw);
    std::vector<uint8_t> keys, values;
    RandomHeads(rng, &keys, &values);
    const std::unique_ptr<KvCache> coded = CodedCache(keys, values, 1 + draw * 11);
    const std::unique_ptr<KvCache> plain = PlainCache(keys, values);
    const std::vector<float> q =
        RandomRows(kHeads * kGroup, dim(), rng, draw % 2 == 0 ? 0.3f : 2.f);
    std::vector<int32_t> idx(kHeads * kSelected);
    for (int32_t& i : idx) i = static_cast<int32_t>(rng() % kKept);
    std::vector<int32_t> sorted = idx;
    for (int h = 0; h < kHeads; ++h) {
      std::sort(sorted.begin() + h * kSelected, sorted.begin() + (h + 1) * kSelected);
    }
    const std::vector<int32_t>* selections[] = {nullptr, &idx, &sorted};
    for (const std::vector<int32_t>* sel : selections) {
      const int n = sel ? kSelected : 0;
      const std::vector<float> want = Attend(**reference, *plain, q, sel, n);
      const std::vector<float> got = Attend(**cpu, *coded, q, sel, n);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        double err = std::fabs(static_cast<double>(got[i]) - want[i]) /
                     (kTolerance.atol + kTolerance.rtol * std::fabs(want[i]));
        if (std::isnan(err)) err = HUGE_VAL;
        if (err > worst) {
          worst = err;
          worst_at = absl::StrCat("draw ", draw, ", ",
                                  !sel          ? "dense"
                                  : sel == &idx ? "sparse"
                                                : "sorted",
                                  ", element ", i, ": ", got[i], " against ", want[i]);
        }
      }
    }
  }
  EXPECT_LE(worst, 1.0) << "the largest error, as a share of the tolerance, at " << worst_at;
  RecordProperty("largest_error_of_tolerance", absl::StrCat(worst, " at ", worst_at));
}

// An fp8 code whose low seven bits are set is NaN (E4M3 has no infinity; the coders write it
// for a NaN input). A cache holding one decodes it as the reference does: a NaN key makes its
// query heads' scores NaN, a NaN value the channel it is in. (The CPU kernel leaves NaN codes
// out of its conversion and does such a head again in its scalar loop.)
TEST_P(CodedCacheTest, Fp8NaNCodesAttendAsTheReference) {
  if (format() != KvFormat::kFP8) GTEST_SKIP() << "only fp8 has NaN codes";
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 2);
  ASSERT_TRUE(reference.ok() && cpu.ok());
  std::mt19937 rng(5);
  std::vector<uint8_t> keys, values;
  RandomHeads(rng, &keys, &values);
  std::unique_ptr<KvCache> cache = CodedCache(keys, values, 290);
  LayerCache& lc = cache->layer(0);
  const int64_t kc = static_cast<int64_t>(KvKeyCodeBytes(format(), dtype(), dim()));
  const int64_t vc = static_cast<int64_t>(KvValueRowBytes(format(), dtype(), dim()));
  static_cast<uint8_t*>(lc.k)[lc.layout.Row(0, 100, kc) + 5] = 0x7f;
  static_cast<uint8_t*>(lc.v)[lc.coding.v_layout.Row(1, 200, vc) + 7] = 0xff;
  const std::vector<float> q = RandomRows(kHeads * kGroup, dim(), rng, 0.3f);
  const auto nans = [](const std::vector<float>& x) {
    return std::count_if(x.begin(), x.end(), [](float f) { return std::isnan(f); });
  };
  const std::vector<float> want = Attend(**reference, *cache, q, nullptr, 0);
  // Cache head 0's query heads: outputs and probabilities; head 1's: channel 7 of the outputs.
  EXPECT_EQ(nans(want), kGroup * dim() + kGroup * lc.len + kGroup);
  const std::vector<float> got = Attend(**cpu, *cache, q, nullptr, 0);
  EXPECT_EQ(nans(got), nans(want));
  EXPECT_TRUE(kernels::AllClose(got, want, kTolerance));
  // Sparse: both rows among those chosen, in order, for each cache head.
  const std::vector<int32_t> idx = {100, 150, 200, 250, 100, 150, 200, 250};
  const std::vector<float> want_sparse = Attend(**reference, *cache, q, &idx, 4);
  EXPECT_EQ(nans(want_sparse), kGroup * dim() + kGroup * 4 + kGroup);
  const std::vector<float> got_sparse = Attend(**cpu, *cache, q, &idx, 4);
  EXPECT_EQ(nans(got_sparse), nans(want_sparse));
  EXPECT_TRUE(kernels::AllClose(got_sparse, want_sparse, kTolerance));
}

// fp8's zero and subnormal codes (low seven bits 0 to 7), which a widening that places a code
// under a float's bits gets wrong (one was tried in the CPU kernel: docs/benchmarks.md). Every
// value code of cache head 0 is such a code, in groups scaled by 2^10 so that a wrong widening
// shows (a code's value is then 2m, where that widening gave 512 + 64m), and so is every third
// key row's. Cache head 1 keeps its codes.
TEST_P(CodedCacheTest, Fp8ZeroAndSubnormalCodesAttendAsTheReference) {
  if (format() != KvFormat::kFP8) GTEST_SKIP() << "only fp8 has subnormal codes";
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 2);
  ASSERT_TRUE(reference.ok() && cpu.ok());
  std::mt19937 rng(9);
  std::vector<uint8_t> keys, values;
  RandomHeads(rng, &keys, &values);
  std::unique_ptr<KvCache> cache = CodedCache(keys, values, 290);
  LayerCache& lc = cache->layer(0);
  for (int g = 0; g < lc.coding.max_groups; ++g) lc.coding.v_scales[g] = 127 + 10;
  const int64_t kc = static_cast<int64_t>(KvKeyCodeBytes(format(), dtype(), dim()));
  const int64_t vc = static_cast<int64_t>(KvValueRowBytes(format(), dtype(), dim()));
  std::uniform_int_distribution<int> small(0, 15);  // a sign and the low three bits
  auto fill = [&](uint8_t* row) {
    for (int i = 0; i < dim(); ++i) {
      const int c = small(rng);
      row[i] = static_cast<uint8_t>((c & 8) << 4 | (c & 7));
    }
  };
  for (int t = 0; t < kKept; ++t) {
    fill(static_cast<uint8_t*>(lc.v) + lc.coding.v_layout.Row(0, t, vc));
    if (t % 3 == 0) fill(static_cast<uint8_t*>(lc.k) + lc.layout.Row(0, t, kc));
  }
  const std::vector<float> q = RandomRows(kHeads * kGroup, dim(), rng, 0.3f);
  const std::vector<float> want = Attend(**reference, *cache, q, nullptr, 0);
  float largest = 0.f;  // cache head 0's outputs: at most 14 (2 · 7)
  for (int i = 0; i < kGroup * dim(); ++i) largest = std::max(largest, std::fabs(want[i]));
  EXPECT_GT(largest, 0.5f);
  EXPECT_LE(largest, 14.f);
  EXPECT_TRUE(kernels::AllClose(Attend(**cpu, *cache, q, nullptr, 0), want, kTolerance));
  const std::vector<int32_t> idx = {3, 4, 5, 99, 150, 299, 3, 4, 5, 99, 150, 299};
  EXPECT_TRUE(kernels::AllClose(Attend(**cpu, *cache, q, &idx, 6),
                                Attend(**reference, *cache, q, &idx, 6), kTolerance));
}

// fp8 value scales reach 2^127 (the coders' E8M0Up gives 254 for an infinite value): the CPU
// kernel, which widens codes to a 2^8 part of their value and puts the 2^8 back into the scale,
// must not overflow there. Group 0 of cache head 1 (its first 128 tokens) scaled by 2^120, its
// codes all 1.0 (0x38): values of 2^120, finite.
TEST_P(CodedCacheTest, Fp8HugeValueScalesAttendAsTheReference) {
  if (format() != KvFormat::kFP8) GTEST_SKIP() << "only fp8 has group value scales";
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 2);
  ASSERT_TRUE(reference.ok() && cpu.ok());
  std::mt19937 rng(6);
  std::vector<uint8_t> keys, values;
  RandomHeads(rng, &keys, &values);
  std::unique_ptr<KvCache> cache = CodedCache(keys, values, 290);
  LayerCache& lc = cache->layer(0);
  ASSERT_EQ(KvGroups{kKept}.Of(127), 0);
  ASSERT_EQ(KvGroups{kKept}.Of(128), 1);
  lc.coding.v_scales[1 * lc.coding.max_groups + 0] = 127 + 120;
  const int64_t vc = static_cast<int64_t>(KvValueRowBytes(format(), dtype(), dim()));
  for (int t = 0; t < 128; ++t) {
    std::memset(static_cast<uint8_t*>(lc.v) + lc.coding.v_layout.Row(1, t, vc), 0x38, dim());
  }
  const std::vector<float> q = RandomRows(kHeads * kGroup, dim(), rng, 0.3f);
  const std::vector<float> want = Attend(**reference, *cache, q, nullptr, 0);
  float largest = 0.f;
  for (float x : want) {
    ASSERT_TRUE(std::isfinite(x));
    largest = std::max(largest, std::fabs(x));
  }
  EXPECT_GT(largest, 1e35f);
  EXPECT_TRUE(kernels::AllClose(Attend(**cpu, *cache, q, nullptr, 0), want, kTolerance));
}

// An int4 value row whose step is infinite: outputs infinite or NaN where the specification's
// are (the integer products, which need finite weights to scale, leave such a head to the float
// kernel).
TEST_P(CodedCacheTest, Int4InfiniteStepsAttendAsTheReference) {
  if (format() != KvFormat::kInt4) GTEST_SKIP() << "only int4 has value steps";
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 2);
  ASSERT_TRUE(reference.ok() && cpu.ok());
  std::mt19937 rng(8);
  std::vector<uint8_t> keys, values;
  RandomHeads(rng, &keys, &values);
  std::unique_ptr<KvCache> cache = CodedCache(keys, values, 290);
  LayerCache& lc = cache->layer(0);
  const int64_t vc = static_cast<int64_t>(KvValueRowBytes(format(), dtype(), dim()));
  const uint16_t inf = 0x7c00;  // f16 +inf, as head 1's rows 40..43 step in their first group
  for (int t = 40; t < 44; ++t) {
    std::memcpy(static_cast<uint8_t*>(lc.v) + lc.coding.v_layout.Row(1, t, vc) + (dim() + 1) / 2,
                &inf, 2);
  }
  const std::vector<float> q = RandomRows(kHeads * kGroup, dim(), rng, 0.3f);
  const std::vector<float> want = Attend(**reference, *cache, q, nullptr, 0);
  const std::vector<float> got = Attend(**cpu, *cache, q, nullptr, 0);
  ASSERT_EQ(got.size(), want.size());
  int non_finite = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isfinite(want[i])) {
      EXPECT_NEAR(got[i], want[i], kTolerance.atol + kTolerance.rtol * std::fabs(want[i])) << i;
      continue;
    }
    ++non_finite;
    EXPECT_EQ(std::isnan(got[i]), std::isnan(want[i])) << i << ": " << got[i] << " vs " << want[i];
    if (std::isinf(want[i])) {
      EXPECT_EQ(got[i], want[i]) << i;
    }
  }
  EXPECT_GT(non_finite, 0);
}

// Its bytes: the codes and their parameters, and a residual of at most a group in the dtype.
TEST_P(CodedCacheTest, TakesAFractionOfThePool) {
  KvCacheShape coded = Shape(format(), dtype()), plain = Shape(KvFormat::kAuto, dtype());
  coded.capacity = plain.capacity = {16384 + 128};
  coded.appended = plain.appended = 128;
  const double ratio = static_cast<double>(KvCache::BytesFor(plain)) / KvCache::BytesFor(coded);
  // Per token and head of 64 values: fp8 64 + 2 bytes of keys (a group's parameters over 128
  // tokens), 64 of values; int8 66 and 66; int4 34 and 36; and 4 of position either way. A
  // pool of bf16 caches takes 260, of float32 516; the residual's 128 rows cost a little.
  // (Other head sizes: at least 1.5x.)
  const bool f32 = dtype() == DType::kF32;
  const double want = dim() != 64                   ? 1.5
                      : format() == KvFormat::kFP8  ? (f32 ? 3.7 : 1.9)
                      : format() == KvFormat::kInt8 ? (f32 ? 3.65 : 1.85)
                                                    : (f32 ? 6.5 : 3.35);
  EXPECT_GT(ratio, want) << KvFormatName(format());
  KvPool pool(size_t{64} << 20, 4096);
  EXPECT_EQ(pool.BytesFor(coded), KvCache::BytesFor(coded));
  // In a device's pool (a GPU decode node's: 64 KiB pages, positions on the host), 16 layers of
  // 8 heads: pages of code rows, and a run of pages for the parameters and residual. At heads of
  // 64 in bf16 it holds 1.94x (fp8) and 3.53x (int4) the bf16 caches.
  coded.n_heads = plain.n_heads = 8;
  coded.capacity = plain.capacity = std::vector<int>(16, 16384 + 128);
  auto backend = kernels::MakeBackend(kernels::BackendKind::kGuarded);
  ASSERT_TRUE(backend.ok());
  auto paged = KvPool::OnBackend(std::move(*backend), size_t{256} << 20, size_t{64} << 10);
  ASSERT_TRUE(paged.ok());
  const double paged_ratio =
      static_cast<double>((*paged)->BytesFor(plain)) / (*paged)->BytesFor(coded);
  const double paged_want = dim() == 64 && !f32 && format() != KvFormat::kInt8
                                ? (format() == KvFormat::kFP8 ? 1.9 : 3.5)
                                : want;
  EXPECT_GT(paged_ratio, paged_want) << KvFormatName(format());
  // What the pool reserves is what a cache takes from it.
  const KvCacheShape small = Shape(format(), dtype());
  auto made = KvCache::CreatePaged(small, **paged);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ((*paged)->used(), (*paged)->BytesFor(small));
}

TEST_P(CodedCacheTest, RefusesRowsAndTheWrongBlocks) {
  auto cache = KvCache::Create(Shape(format(), dtype()), HeapKvAllocator());
  ASSERT_TRUE(cache.ok());
  std::vector<uint8_t> rows(64 * dim() * 4);
  const absl::Status st = (*cache)->WriteRows(0, 0, 0, 1, rows.data(), rows.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  (*cache)->layer(0).coding.kept = 10;
  EXPECT_EQ((*cache)->WriteCodedBlock(0, 0, 5, 6, rows.data(), rows.data()).code(),
            absl::StatusCode::kInvalidArgument);  // past the kept tokens
  EXPECT_EQ((*cache)->WriteCodedBlock(0, kHeads, 0, 1, rows.data(), rows.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// The device backends' kernels over a coded cache in their pool's pages (the guarded emulation
// always; CUDA where a GPU is present): decode attention, summaries and exact scores as the
// reference reads the same codes, and the groups that AppendKv codes on the device, byte for
// byte the host's.
TEST_P(CodedCacheTest, DeviceKernelsReadAndCodeAsTheHost) {
  std::vector<kernels::BackendKind> kinds = {kernels::BackendKind::kGuarded};
  if (kernels::CudaAvailable()) kinds.push_back(kernels::BackendKind::kCuda);
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  ASSERT_TRUE(reference.ok());
  for (kernels::BackendKind kind : kinds) {
    SCOPED_TRACE(kernels::BackendName(kind));
    auto made = kernels::MakeBackend(kind, 2);
    ASSERT_TRUE(made.ok()) << made.status();
    // Small pages (42 to 341 tokens of code rows): the length runs pages past the rows in pages.
    auto pool = KvPool::OnBackend(std::move(*made), size_t{64} << 20, size_t{4} << 10);
    ASSERT_TRUE(pool.ok()) << pool.status();
    kernels::KernelBackend& device = *(*pool)->backend();
    std::mt19937 rng(17);
    std::vector<uint8_t> keys, values;
    RandomHeads(rng, &keys, &values);
    std::unique_ptr<KvCache> on_ref = CodedCache(keys, values, 120);
    std::unique_ptr<KvCache> on_dev = CodedCache(keys, values, 7, pool->get());
    ASSERT_TRUE(on_dev->layer(0).paged());
    for (int step = 0; step <= kAppended; ++step) {
      SCOPED_TRACE(absl::StrCat("after ", step, " appended"));
      if (step % 43 == 0 || step == kAppended) {
        const std::vector<float> q = RandomRows(kHeads * kGroup, dim(), rng, 0.3f);
        ASSERT_TRUE(kernels::AllClose(Attend(device, *on_dev, q, nullptr, 0),
                                      Attend(**reference, *on_ref, q, nullptr, 0), kTolerance));
        ASSERT_TRUE(kernels::AllClose(Selection(device, *on_dev, q),
                                      Selection(**reference, *on_ref, q), kTolerance));
        const int n = 40;
        std::vector<int32_t> idx(kHeads * n);
        for (int32_t& i : idx) i = static_cast<int32_t>(rng() % on_ref->layer(0).len);
        ASSERT_TRUE(kernels::AllClose(Attend(device, *on_dev, q, &idx, n),
                                      Attend(**reference, *on_ref, q, &idx, n), kTolerance));
        // Without probabilities, as a decode step asks (on cuda: the split over warps).
        ASSERT_TRUE(kernels::AllClose(Attend(device, *on_dev, q, nullptr, 0, false),
                                      Attend(**reference, *on_ref, q, nullptr, 0, false),
                                      kTolerance));
      }
      if (step == kAppended) break;
      const int t = kKept + step;
      const std::vector<float> k = RandomRows(kHeads, dim(), rng),
                               v = RandomRows(kHeads, dim(), rng, 0.5f);
      for (auto [backend, cache] :
           {std::pair{reference->get(), on_ref.get()}, std::pair{&device, on_dev.get()}}) {
        LayerCache& lc = cache->layer(0);
        kernels::Arena arena(*backend);
        KvAppend a{arena.Upload(k), arena.Upload(v), lc.k, lc.v, lc.layout, lc.coding, t};
        const absl::Status st = backend->AppendKv({&a, 1, kHeads, kHeads, dim(), dtype()});
        ASSERT_TRUE(st.ok()) << st;
        ASSERT_TRUE(backend->Synchronize().ok());
        lc.len = t + 1;
      }
    }
    EXPECT_TRUE(
        SameBytes(LayerBytes(device, on_dev->layer(0)), LayerBytes(**reference, on_ref->layer(0))));
  }
}

// A batch mixing every coded format in one call, as a decode node whose requests chose different
// formats steps them together: long caches (split over many chunks of key groups), appended
// groups coded on the backend and a residual, the head dims and query-head groups the models
// use; beside them a cache in the dtype and a coded one attended through a sparse selection.
// On cuda the call is split by kernel: the dense coded sequences through coded_decode.cu, the
// cache in the dtype through FlashInfer where it serves it (bf16), the rest through the plain
// kernel (each route checked); on guarded it runs the CPU kernels. All against the reference.
TEST(CodedDecodeBatch, MixedFormatsEqualTheReference) {
  std::vector<kernels::BackendKind> kinds = {kernels::BackendKind::kGuarded};
  if (kernels::CudaAvailable()) kinds.push_back(kernels::BackendKind::kCuda);
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  ASSERT_TRUE(reference.ok());
  struct Case {
    int d, group;
    DType dtype;
  };
  // (Dense heads of 128 and 256 take int4's integer products where the CPU has VNNI, in groups
  // of 16 rows by 1, 2, 4 or 8 query heads.)
  const Case cases[] = {{128, 4, DType::kBF16}, {64, 8, DType::kF32},   {256, 1, DType::kF16},
                        {128, 2, DType::kF32},  {128, 8, DType::kBF16}, {256, 8, DType::kBF16}};
  struct Seq {
    KvFormat format;
    int kept, appended;
    int chosen = 0;       // tokens chosen per cache head (sparse attention), 0: all
    bool sorted = false;  // chosen in order, as the selections give them: the CPU kernel then
                          // takes runs of a key group's rows in blocks
  };
  // 1500 kept: 11 groups of 128, one of 76 and the recent 16; 150 appended: a group coded and 22
  // in the residual.
  const Seq batch[] = {{KvFormat::kInt4, 1500, 150},
                       {KvFormat::kFP8, 290, 0},
                       {KvFormat::kAuto, 500, 5},
                       {KvFormat::kInt8, 40, 3},
                       {KvFormat::kInt8, 300, 0, 60},
                       {KvFormat::kInt4, 7, 0},
                       {KvFormat::kInt4, 1500, 150, 500, true},
                       {KvFormat::kFP8, 1000, 20, 400, true}};
  constexpr int kCacheHeads = 2;
  for (kernels::BackendKind kind : kinds) {
    for (const Case& cs : cases) {
      SCOPED_TRACE(absl::StrCat(kernels::BackendName(kind), " d ", cs.d, " group ", cs.group, " ",
                                DTypeName(cs.dtype)));
      auto made = kernels::MakeBackend(kind, 2);
      ASSERT_TRUE(made.ok()) << made.status();
      auto pool = KvPool::OnBackend(std::move(*made), size_t{64} << 20, size_t{64} << 10);
      ASSERT_TRUE(pool.ok()) << pool.status();
      kernels::KernelBackend& device = *(*pool)->backend();
      kernels::Arena dev_arena(device), ref_arena(**reference);
      std::mt19937 rng(23);
      const int n_heads = kCacheHeads * cs.group;
      std::vector<std::unique_ptr<KvCache>> on_ref, on_dev;
      std::vector<DecodeSequence> ref_seqs, dev_seqs;
      std::vector<float*> dev_out, ref_out;
      for (size_t b = 0; b < std::size(batch); ++b) {
        const Seq& sq = batch[b];
        on_ref.push_back(RandomCache(sq.format, cs.dtype, cs.d, kCacheHeads, sq.kept, sq.appended,
                                     100 + b, nullptr));
        on_dev.push_back(RandomCache(sq.format, cs.dtype, cs.d, kCacheHeads, sq.kept, sq.appended,
                                     100 + b, pool->get()));
        ASSERT_TRUE(on_ref.back() && on_dev.back());
        for (int step = 0; step < sq.appended; ++step) {
          const std::vector<float> k = RandomRows(kCacheHeads, cs.d, rng),
                                   v = RandomRows(kCacheHeads, cs.d, rng, 0.5f);
          for (auto [backend, cache] : {std::pair{reference->get(), on_ref.back().get()},
                                        std::pair{&device, on_dev.back().get()}}) {
            LayerCache& lc = cache->layer(0);
            kernels::Arena arena(*backend);
            KvAppend a{arena.Upload(k), arena.Upload(v), lc.k,          lc.v,
                       lc.layout,       lc.coding,       sq.kept + step};
            const absl::Status st =
                backend->AppendKv({&a, 1, kCacheHeads, kCacheHeads, cs.d, cs.dtype});
            ASSERT_TRUE(st.ok()) << st;
            ASSERT_TRUE(backend->Synchronize().ok());
            lc.len = sq.kept + step + 1;
          }
        }
        const std::vector<float> q = RandomRows(n_heads, cs.d, rng, 0.3f);
        std::vector<int32_t> chosen;
        for (int i = 0; i < kCacheHeads * sq.chosen; ++i) {
          chosen.push_back(static_cast<int32_t>(rng() % on_ref.back()->layer(0).len));
        }
        if (sq.sorted) {
          for (int c = 0; c < kCacheHeads; ++c) {
            std::sort(chosen.begin() + c * sq.chosen, chosen.begin() + (c + 1) * sq.chosen);
          }
        }
        for (auto [arena, cache, seqs, outs] :
             {std::tuple{&ref_arena, on_ref.back().get(), &ref_seqs, &ref_out},
              std::tuple{&dev_arena, on_dev.back().get(), &dev_seqs, &dev_out}}) {
          const LayerCache& lc = cache->layer(0);
          DecodeSequence s;
          s.q = arena->Upload(q);
          s.out = arena->Zeros(q.size());
          s.k = lc.k;
          s.v = lc.v;
          s.layout = lc.layout;
          s.coding = lc.coding;
          s.len = lc.len;
          if (sq.chosen > 0) {
            s.indices = arena->Upload(chosen);
            s.num_indices = sq.chosen;
          }
          seqs->push_back(s);
          outs->push_back(s.out);
        }
      }
      auto params = [&](const std::vector<DecodeSequence>& seqs) {
        DecodeAttentionParams p;
        p.seqs = seqs.data();
        p.batch = static_cast<int>(seqs.size());
        p.n_heads = n_heads;
        p.n_cache_heads = kCacheHeads;
        p.head_dim = cs.d;
        p.kv_dtype = cs.dtype;
        p.scale = 1.f / std::sqrt(static_cast<float>(cs.d));
        return p;
      };
#if KVWIRE_HAS_CUDA
      const int64_t coded_before = kernels::cuda::CodedDecodeLaunches();
#endif
      const int64_t library_before = kernels::FlashInferDecodeLaunchesHere();
      ASSERT_TRUE((*reference)->DecodeAttention(params(ref_seqs)).ok());
      const absl::Status st = device.DecodeAttention(params(dev_seqs));
      ASSERT_TRUE(st.ok()) << st;
      const bool library = kernels::FlashInferDecodeLaunchesHere() > library_before;
      const bool on_cuda =
          kind == kernels::BackendKind::kCuda && kernels::CudaAttentionChoice() != "native";
#if KVWIRE_HAS_CUDA
      if (on_cuda) {
        EXPECT_GT(kernels::cuda::CodedDecodeLaunches(), coded_before)
            << "coded_decode.cu did not run";
      }
#endif
      // FlashInfer reads paged bf16 caches of head_dim 64 or 128.
      EXPECT_EQ(library,
                on_cuda && kernels::FlashInferBuilt() && cs.dtype == DType::kBF16 && cs.d <= 128);
      for (size_t b = 0; b < std::size(batch); ++b) {
        SCOPED_TRACE(absl::StrCat("sequence ", b, " (", KvFormatName(batch[b].format), ")"));
        const size_t n = static_cast<size_t>(n_heads) * cs.d;
        // FlashInfer's outputs are f16: half a unit in their 11th bit.
        const kernels::Tolerance tolerance = library && batch[b].format == KvFormat::kAuto
                                                 ? kernels::Tolerance{1e-3f, 1e-3f}
                                                 : kTolerance;
        EXPECT_TRUE(kernels::AllClose(dev_arena.Download(dev_out[b], n),
                                      ref_arena.Download(ref_out[b], n), tolerance));
      }
    }
  }
}

// Heads of 64 (the CPU kernel in AVX-512 vectors where the machine has them), 96 (AVX2's), 24
// (neither: the scalar loop), 128 (int4's dense attention in VNNI's integer products where the
// machine has them) and 256.
INSTANTIATE_TEST_SUITE_P(Formats, CodedCacheTest,
                         ::testing::Combine(::testing::Values(KvFormat::kFP8, KvFormat::kInt8,
                                                              KvFormat::kInt4),
                                            ::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(64, 96, 24, 128, 256)),
                         [](const auto& info) {
                           return absl::StrCat(KvFormatName(std::get<0>(info.param)), "_",
                                               DTypeName(std::get<1>(info.param)), "_d",
                                               std::get<2>(info.param));
                         });

}  // namespace
}  // namespace kvwire
