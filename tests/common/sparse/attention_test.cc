// Decode attention modes against naive references written from their definitions
// (docs/algorithms.md §3-4): page summaries stay exact as tokens append; hybrid, quest and
// exact top-k select what brute force selects; hybrid and quest equal, bit for bit, the
// row-at-a-time formulation they were first written as; the parallel selection (heads and
// sequences on several threads) equals the serial one, ties and odd head counts included;
// hybrid with every dimension and one-token pages is exact top-k; and a budget covering the
// cache is dense attention.
#include "common/sparse/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "common/base/ranking.h"
#include "common/engine/generate.h"
#include "common/sparse/rocketkv.h"
#include "kernels/simd.h"
#include "kernels/thread_pool.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

ModelConfig Shape(int heads, int kv, int d) {
  ModelConfig c;
  c.num_heads = heads;
  c.num_kv_heads = kv;
  c.head_dim = d;
  c.num_layers = 1;
  return c;
}

std::unique_ptr<KvCache> RandomCache(int heads, int d, int len, int capacity, DType dtype,
                                     std::mt19937& rng) {
  KvCacheShape shape{heads, d, dtype, {capacity}};
  auto cache = *KvCache::Create(shape, HeapKvAllocator());
  std::normal_distribution<float> n(0.f, 1.f);
  LayerCache& lc = cache->layer(0);
  std::vector<float> row(d);
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < capacity; ++t) {
      for (float& x : row) x = n(rng) * (t % 7 == 0 ? 3.f : 1.f);  // some salient tokens
      FromFloat(dtype, row.data(), lc.k_row(h, t), d);
      for (float& x : row) x = n(rng);
      FromFloat(dtype, row.data(), lc.v_row(h, t), d);
      lc.positions[int64_t{h} * capacity + t] = t;
    }
  }
  lc.len = len;
  return cache;
}

// Copies a layer's rows, positions and length into another of the same shape.
void CopyLayer(const LayerCache& src, LayerCache* dst) {
  std::memcpy(dst->k, src.k, src.row_bytes() * src.n_heads * src.capacity);
  std::memcpy(dst->v, src.v, src.row_bytes() * src.n_heads * src.capacity);
  std::memcpy(dst->positions, src.positions, sizeof(int32_t) * src.n_heads * src.capacity);
  dst->len = src.len;
}

std::vector<float> RowOf(const LayerCache& lc, int h, int t) {
  std::vector<float> r(lc.head_dim);
  ToFloat(lc.dtype, lc.k_row(h, t), r.data(), lc.head_dim);
  return r;
}

// Takes whole pages by (score desc, page asc) until k slots, the last page cut low.
std::set<int32_t> TakeRef(const std::vector<double>& page_score, int page, int len, int k) {
  std::vector<int> order(page_score.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return page_score[a] > page_score[b]; });
  std::set<int32_t> out;
  for (int p : order) {
    for (int t = p * page; t < std::min(len, (p + 1) * page); ++t) {
      if (static_cast<int>(out.size()) < k) out.insert(t);
    }
  }
  return out;
}

// RocketKV Algorithm 2, from its definition: pages' min/max straight from the token rows.
std::set<int32_t> HybridRef(const LayerCache& lc, int c, const float* q, int group, int r, int page,
                            int k) {
  const int d = lc.head_dim, n_pages = (lc.len + page - 1) / page;
  std::vector<double> a(d, 0), sum(d, 0);
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < d; ++i) {
      a[i] += std::fabs(q[g * d + i]);
      sum[i] += q[g * d + i];
    }
  }
  std::vector<int> dims(d);
  std::iota(dims.begin(), dims.end(), 0);
  std::stable_sort(dims.begin(), dims.end(), [&](int x, int y) { return a[x] > a[y]; });
  dims.resize(r);
  std::vector<double> score(n_pages, 0);
  for (int g = 0; g < group; ++g) {
    const float* qh = q + g * d;
    double num = 0, den = 0;
    for (int i : dims) num += std::fabs(qh[i]);
    for (int i = 0; i < d; ++i) den += std::fabs(qh[i]);
    const double scale = std::sqrt(d * num / den);
    std::vector<double> logit(n_pages);
    for (int p = 0; p < n_pages; ++p) {
      double u = 0;
      for (int i : dims) {
        double lo = 1e30, hi = -1e30;
        for (int t = p * page; t < std::min(lc.len, (p + 1) * page); ++t) {
          const double v = RowOf(lc, c, t)[i];
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
        u += qh[i] * (sum[i] >= 0 ? hi : lo);
      }
      logit[p] = u / scale;
    }
    const double mx = *std::max_element(logit.begin(), logit.end());
    double z = 0;
    for (int p = 0; p < n_pages; ++p)
      z += std::exp(logit[p] - mx) * (std::min(lc.len, (p + 1) * page) - p * page);
    for (int p = 0; p < n_pages; ++p) score[p] += std::exp(logit[p] - mx) / z;
  }
  return TakeRef(score, page, lc.len, k);
}

std::set<int32_t> QuestRef(const LayerCache& lc, int c, const float* q, int group, int page,
                           int k) {
  const int d = lc.head_dim, n_pages = (lc.len + page - 1) / page;
  std::vector<double> bound(n_pages, 0);
  for (int p = 0; p < n_pages; ++p) {
    for (int i = 0; i < d; ++i) {
      double lo = 1e30, hi = -1e30;
      for (int t = p * page; t < std::min(lc.len, (p + 1) * page); ++t) {
        lo = std::min<double>(lo, RowOf(lc, c, t)[i]);
        hi = std::max<double>(hi, RowOf(lc, c, t)[i]);
      }
      for (int g = 0; g < group; ++g) bound[p] += std::max(q[g * d + i] * lo, q[g * d + i] * hi);
    }
  }
  return TakeRef(bound, page, lc.len, k);
}

std::set<int32_t> ExactRef(const LayerCache& lc, int c, const float* q, int group, int k) {
  const int d = lc.head_dim;
  std::vector<double> total(lc.len, 0);
  for (int g = 0; g < group; ++g) {
    std::vector<double> s(lc.len);
    for (int t = 0; t < lc.len; ++t) {
      const auto row = RowOf(lc, c, t);
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += q[g * d + i] * row[i];
      s[t] = dot / std::sqrt(static_cast<double>(d));
    }
    const double mx = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double& x : s) z += x = std::exp(x - mx);
    for (int t = 0; t < lc.len; ++t) total[t] += s[t] / z;
  }
  return TakeRef(total, 1, lc.len, k);
}

std::set<int32_t> Selected(const std::vector<int32_t>& idx, int c, int k) {
  return std::set<int32_t>(idx.begin() + static_cast<long>(c) * k,
                           idx.begin() + static_cast<long>(c + 1) * k);
}

// Float rounding (float32 here, float64 in the reference) may swap items whose scores
// tie to ~1e-6; allow a difference of at most one token per head in rare cases.
void ExpectSameSelection(const std::set<int32_t>& got, const std::set<int32_t>& want,
                         const std::string& what) {
  std::vector<int32_t> diff;
  std::set_symmetric_difference(got.begin(), got.end(), want.begin(), want.end(),
                                std::back_inserter(diff));
  EXPECT_LE(diff.size(), 2u) << what;
}

TEST(SparseAttention, ModesMatchNaiveReferences) {
  std::mt19937 rng(9);
  int exact = 0, cases = 0;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int trial = 0; trial < 12; ++trial) {
      const int kv = 1 + static_cast<int>(rng() % 2), group = 1 + static_cast<int>(rng() % 4);
      const int d = std::vector<int>{8, 16, 64}[rng() % 3];
      const int len = 20 + static_cast<int>(rng() % 300);
      const int k = 1 + static_cast<int>(rng() % (len - 1));
      const int page = 1 + static_cast<int>(rng() % 8), r = 1 + static_cast<int>(rng() % d);
      const ModelConfig mc = Shape(kv * group, kv, d);
      auto cache = RandomCache(kv, d, len, len + 4, dtype, rng);
      std::vector<float> q(static_cast<size_t>(kv) * group * d);
      std::normal_distribution<float> n(0.f, 1.f);
      for (float& x : q) x = n(rng);
      for (AttentionMode mode :
           {AttentionMode::kHybrid, AttentionMode::kQuest, AttentionMode::kExactTopK}) {
        DecodeAttentionConfig a;
        a.mode = mode;
        a.top_k = k;
        if (mode == AttentionMode::kHybrid) a.top_r = r;  // each mode takes its own
        if (mode != AttentionMode::kExactTopK) a.page_size = page;
        auto sel = MakeDecodeSelector(a, mc, cache->shape(), HeapKvAllocator());
        ASSERT_TRUE(sel.ok()) << sel.status();
        std::vector<int32_t> idx;
        int num = 0;
        auto sparse = (*sel)->Select(0, q.data(), cache->layer(0), &idx, &num);
        ASSERT_TRUE(sparse.ok());
        ASSERT_TRUE(*sparse);
        // Quest attends whole pages: k rounded down to them, at least one.
        const int km = mode == AttentionMode::kQuest ? std::max(1, k / page) * page : k;
        ASSERT_EQ(num, km);
        for (int c = 0; c < kv; ++c) {
          const float* qc = q.data() + static_cast<size_t>(c) * group * d;
          const std::set<int32_t> got = Selected(idx, c, km);
          ASSERT_EQ(static_cast<int>(got.size()), km) << "distinct tokens";
          std::set<int32_t> want;
          if (mode == AttentionMode::kHybrid)
            want = HybridRef(cache->layer(0), c, qc, group, r, page, k);
          if (mode == AttentionMode::kQuest)
            want = QuestRef(cache->layer(0), c, qc, group, page, km);
          if (mode == AttentionMode::kExactTopK) want = ExactRef(cache->layer(0), c, qc, group, k);
          ExpectSameSelection(
              got, want, std::string(AttentionModeName(mode)) + " trial " + std::to_string(trial));
          exact += got == want;
          ++cases;
        }
      }
    }
  }
  EXPECT_GE(exact, cases * 9 / 10) << "near-ties explain a few, not many";
}

// Hybrid attention as first written: lines 4-6 one summary row at a time down all pages
// (simd::Axpy per dimension and query head), then scale, max, softmax and TakePages with a
// partial sort. The tiled, register-blocked version must choose exactly this, in this order.
std::vector<int32_t> HybridRowByRow(const PageSummaries& sums, const LayerCache& lc, int c,
                                    const float* q, int group, int r, int k) {
  const int d = lc.head_dim, n_pages = sums.pages(lc.len), page = sums.page();
  std::vector<float> a(d, 0.f), sum(d, 0.f);
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < d; ++i) {
      a[i] += std::fabs(q[g * d + i]);
      sum[i] += q[g * d + i];
    }
  }
  std::vector<int32_t> dims(d);
  std::iota(dims.begin(), dims.end(), 0);
  std::partial_sort(dims.begin(), dims.begin() + r, dims.end(), BestFirst<float>{a.data()});
  std::vector<float> u(static_cast<size_t>(group) * n_pages, 0.f), row(n_pages);
  for (int x = 0; x < r; ++x) {
    const int i = dims[x];
    for (int p = 0; p < n_pages; ++p) row[p] = sums.Value(0, c, sum[i] >= 0.f, i, p);
    for (int g = 0; g < group; ++g) {
      kernels::simd::Axpy(q[g * d + i], row.data(), DType::kF32, u.data() + g * n_pages, n_pages);
    }
  }
  const int last_page_slots = lc.len - (n_pages - 1) * page;
  std::vector<float> score(n_pages, 0.f);
  for (int g = 0; g < group; ++g) {
    const float* qh = q + g * d;
    float num = 0.f, den = 0.f;
    for (int x = 0; x < r; ++x) num += std::fabs(qh[dims[x]]);
    for (int i = 0; i < d; ++i) den += std::fabs(qh[i]);
    const float inv_scale = den > 0.f && num > 0.f ? 1.f / std::sqrt(d * num / den) : 1.f;
    float* ug = u.data() + g * n_pages;
    float mx = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < n_pages; ++p) {
      ug[p] *= inv_scale;
      mx = std::max(mx, ug[p]);
    }
    const float total = kernels::simd::ExpShiftSum(ug, n_pages, mx);
    const float z = total * page - ug[n_pages - 1] * static_cast<float>(page - last_page_slots);
    kernels::simd::Axpy(1.f / z, ug, DType::kF32, score.data(), n_pages);
  }
  std::vector<int32_t> order(n_pages), out;
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), BestFirst<float>{score.data()});
  for (int p : order) {
    for (int t = p * page; t < std::min(lc.len, (p + 1) * page); ++t) {
      if (static_cast<int>(out.size()) < k) out.push_back(t);
    }
  }
  return out;
}

// Quest as first written: the bound one summary row at a time (dimension, then query head).
std::vector<int32_t> QuestRowByRow(const PageSummaries& sums, const LayerCache& lc, int c,
                                   const float* q, int group, int k) {
  const int d = lc.head_dim, n_pages = sums.pages(lc.len), page = sums.page();
  std::vector<float> bound(n_pages, 0.f), hi(n_pages), lo(n_pages);
  for (int i = 0; i < d; ++i) {
    for (int p = 0; p < n_pages; ++p) {
      hi[p] = sums.Value(0, c, true, i, p);
      lo[p] = sums.Value(0, c, false, i, p);
    }
    for (int g = 0; g < group; ++g) {
      const float qi = q[g * d + i];
      kernels::simd::Axpy(qi, qi >= 0.f ? hi.data() : lo.data(), DType::kF32, bound.data(),
                          n_pages);
    }
  }
  std::vector<int32_t> order(n_pages), out;
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), BestFirst<float>{bound.data()});
  for (int p : order) {
    for (int t = p * page; t < std::min(lc.len, (p + 1) * page); ++t) {
      if (static_cast<int>(out.size()) < k) out.push_back(t);
    }
  }
  return out;
}

// Keys a few float32 ulps from one row per head: every page's score ties with the others' to
// within rounding, so which pages win, and in which order, depends on every rounding — a
// scorer that summed in another order would choose otherwise.
std::unique_ptr<KvCache> NearTieCache(int heads, int d, int len, int capacity, std::mt19937& rng) {
  auto cache = RandomCache(heads, d, len, capacity, DType::kF32, rng);
  LayerCache& lc = cache->layer(0);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> base(d), row(d);
  for (int h = 0; h < heads; ++h) {
    for (float& x : base) x = n(rng);
    for (int t = 0; t < capacity; ++t) {
      for (int i = 0; i < d; ++i) {
        row[i] = base[i];
        const int steps = static_cast<int>(rng() % 7) - 3;
        for (int s = 0; s < std::abs(steps); ++s) {
          row[i] = std::nextafter(row[i], steps > 0 ? 1e30f : -1e30f);
        }
      }
      FromFloat(DType::kF32, row.data(), lc.k_row(h, t), d);
    }
  }
  return cache;
}

// Page counts on both sides of whole vectors (8 and 16) and tiles (64), every group size the
// vector path is compiled for and some it is not, both dtypes, and scores tied to within
// rounding: the same tokens in the same order.
TEST(SparseAttention, HybridAndQuestEqualTheRowByRowFormulation) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.f, 1.f);
  int cases = 0;
  for (int keys = 0; keys < 3; ++keys) {  // bf16, f32, f32 tied to within rounding
    const DType dtype = keys == 0 ? DType::kBF16 : DType::kF32;
    for (int group : {1, 2, 3, 4, 5, 8, 12}) {  // 12: the softmax's rows in two passes
      for (int len : {9, 63, 64, 65, 200, 517, 1031}) {
        const int page = 1 + static_cast<int>(rng() % 4), d = group % 2 ? 16 : 32;
        const int r = 1 + static_cast<int>(rng() % d), kv = 2;
        const int k = 1 + static_cast<int>(rng() % (len - 1));
        const ModelConfig mc = Shape(kv * group, kv, d);
        auto cache = keys == 2 ? NearTieCache(kv, d, len, len + 3, rng)
                               : RandomCache(kv, d, len, len + 3, dtype, rng);
        std::vector<float> q(static_cast<size_t>(kv) * group * d);
        for (float& x : q) x = n(rng);
        for (AttentionMode mode : {AttentionMode::kHybrid, AttentionMode::kQuest}) {
          DecodeAttentionConfig a;
          a.mode = mode;
          a.top_k = k;
          a.page_size = page;
          if (mode == AttentionMode::kHybrid) a.top_r = r;
          auto sel = MakeDecodeSelector(a, mc, cache->shape(), HeapKvAllocator());
          ASSERT_TRUE(sel.ok()) << sel.status();
          std::vector<int32_t> idx;
          int num = 0;
          ASSERT_TRUE(*(*sel)->Select(0, q.data(), cache->layer(0), &idx, &num));
          PageSummaries sums(
              cache->shape(), page,
              *HeapKvAllocator().Allocate(PageSummaries::Bytes(cache->shape(), page)));
          sums.Update(0, cache->layer(0));
          for (int c = 0; c < kv; ++c) {
            const float* qc = q.data() + static_cast<size_t>(c) * group * d;
            const std::vector<int32_t> want =
                mode == AttentionMode::kHybrid
                    ? HybridRowByRow(sums, cache->layer(0), c, qc, group, r, num)
                    : QuestRowByRow(sums, cache->layer(0), c, qc, group, num);
            const std::vector<int32_t> got(idx.begin() + static_cast<long>(c) * num,
                                           idx.begin() + static_cast<long>(c + 1) * num);
            ASSERT_EQ(got, want) << AttentionModeName(mode) << " group " << group << " len " << len
                                 << " page " << page << " r " << r << " k " << k;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 7 * 7 * 2 * 2);
}

// A cache whose keys take a few integer values: page summaries, bounds and scores tie
// everywhere, so the selection is decided by the tie rule (the lower page first).
std::unique_ptr<KvCache> TiedCache(int heads, int d, int len, int capacity, DType dtype,
                                   std::mt19937& rng) {
  auto cache = RandomCache(heads, d, len, capacity, dtype, rng);
  LayerCache& lc = cache->layer(0);
  std::vector<float> row(d);
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < capacity; ++t) {
      for (float& x : row) x = static_cast<float>(static_cast<int>(rng() % 3) - 1);
      FromFloat(dtype, row.data(), lc.k_row(h, t), d);
    }
  }
  return cache;
}

// Every head of several selectors at once on a pool of four threads, in whatever order the
// pool runs them, while tokens are appended: the same indices as Select, head by head in
// order on one thread. Odd head counts, groups of 1 to 8, tied and untied keys.
TEST(SparseAttention, ParallelSelectionEqualsSerial) {
  kernels::ThreadPool pool(4);
  std::mt19937 rng(21);
  std::normal_distribution<float> n(0.f, 1.f);
  for (bool tied : {true, false}) {
    for (int kv : {1, 3, 5, 7}) {
      for (int group : {1, 3, 4, 8}) {
        const int d = 16, len = 150 + static_cast<int>(rng() % 300), steps = 4;
        const DType dtype = kv % 2 ? DType::kBF16 : DType::kF32;
        const ModelConfig mc = Shape(kv * group, kv, d);
        auto cache = tied ? TiedCache(kv, d, len, len + steps, dtype, rng)
                          : RandomCache(kv, d, len, len + steps, dtype, rng);
        std::vector<std::unique_ptr<DecodeSelector>> serial, parallel;
        const std::vector<AttentionMode> modes = {AttentionMode::kHybrid, AttentionMode::kQuest,
                                                  AttentionMode::kExactTopK};
        for (AttentionMode mode : modes) {
          DecodeAttentionConfig a;
          a.mode = mode;
          a.token_budget = 40;
          serial.push_back(*MakeDecodeSelector(a, mc, cache->shape(), HeapKvAllocator()));
          parallel.push_back(*MakeDecodeSelector(a, mc, cache->shape(), HeapKvAllocator()));
        }
        LayerCache& lc = cache->layer(0);
        for (int step = 0; step < steps; ++step, ++lc.len) {
          std::vector<float> q(static_cast<size_t>(kv) * group * d);
          for (float& x : q)
            x = tied ? static_cast<float>(static_cast<int>(rng() % 5) - 2) : n(rng);
          std::vector<std::vector<int32_t>> got(modes.size());
          std::vector<int> num(modes.size());
          for (size_t m = 0; m < modes.size(); ++m) {
            ASSERT_TRUE(*parallel[m]->Plan(0, lc, &num[m]));
            got[m].assign(static_cast<size_t>(kv) * num[m], -1);
          }
          // All (mode, head) pairs as one job, as the model runs a batch.
          const int64_t tasks = static_cast<int64_t>(modes.size()) * kv;
          pool.ParallelFor(tasks, 1, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
              const size_t m = t / kv;
              const int c = static_cast<int>(t % kv);
              parallel[m]->SelectHead(0, q.data(), lc, c,
                                      got[m].data() + static_cast<size_t>(c) * num[m]);
            }
          });
          for (size_t m = 0; m < modes.size(); ++m) {
            std::vector<int32_t> want;
            int want_num = 0;
            ASSERT_TRUE(*serial[m]->Select(0, q.data(), lc, &want, &want_num));
            ASSERT_EQ(num[m], want_num);
            ASSERT_EQ(got[m], want) << AttentionModeName(modes[m]) << (tied ? " tied" : "")
                                    << " kv " << kv << " group " << group << " step " << step;
          }
        }
      }
    }
  }
}

// Wraps a sequence's selector inside the model and checks every layer's parallel selection
// against a twin selector's serial one on the same query and cache.
class SerialTwinCheck final : public WrappingSelector {
 public:
  SerialTwinCheck(std::unique_ptr<DecodeSelector> inner, std::unique_ptr<DecodeSelector> twin)
      : WrappingSelector(inner.get()), inner_(std::move(inner)), twin_(std::move(twin)) {}
  void Done(int layer, const float* q, const LayerCache& lc, const int32_t* indices,
            int num) override {
    WrappingSelector::Done(layer, q, lc, indices, num);
    std::vector<int32_t> want;
    int want_num = 0;
    const bool sparse = *twin_->Select(layer, q, lc, &want, &want_num);
    EXPECT_EQ(sparse, indices != nullptr);
    if (sparse && indices != nullptr) {
      EXPECT_EQ(num, want_num);
      EXPECT_EQ(std::vector<int32_t>(indices, indices + static_cast<size_t>(lc.n_heads) * num),
                want)
          << "layer " << layer;
      ++sparse_layers;
    }
  }
  int sparse_layers = 0;

 private:
  std::unique_ptr<DecodeSelector> inner_, twin_;
};

// The model selects every sequence's heads at once on its threads: across batch sizes, odd
// KV head counts and a mix of modes and cache lengths, each sequence gets the serial selection.
TEST(SparseAttention, ModelBatchSelectsAsSerialAcrossBatchSizes) {
  for (const char* spec : {"synthetic:tiny,heads=9,kv_heads=3,head_dim=16",
                           "synthetic:tiny,heads=5,kv_heads=5,head_dim=16",
                           "synthetic:tiny,heads=8,kv_heads=1,head_dim=16,dtype=bf16"}) {
    LoadOptions lo;
    lo.threads = 3;
    auto model = LlamaModel::Load(spec, lo);
    ASSERT_TRUE(model.ok()) << model.status();
    const ModelConfig& mc = (*model)->config();
    std::mt19937 rng(31);
    for (int bsz : {1, 2, 3, 5}) {
      std::vector<std::unique_ptr<KvCache>> caches;
      std::vector<std::unique_ptr<SerialTwinCheck>> selectors;
      std::vector<DecodeInput> batch;
      for (int b = 0; b < bsz; ++b) {
        const int len = 100 + 37 * b;
        KvCacheShape shape{mc.num_kv_heads, mc.head_dim, (*model)->kv_dtype(),
                           std::vector<int>(mc.num_layers, len + 8)};
        caches.push_back(*KvCache::Create(shape, HeapKvAllocator()));
        for (int l = 0; l < mc.num_layers; ++l) {
          auto one = RandomCache(mc.num_kv_heads, mc.head_dim, len, len + 8, shape.dtype, rng);
          CopyLayer(one->layer(0), &caches.back()->layer(l));
        }
        DecodeAttentionConfig a;
        a.mode = std::vector<AttentionMode>{AttentionMode::kHybrid, AttentionMode::kQuest,
                                            AttentionMode::kExactTopK}[b % 3];
        a.token_budget = 24 + 8 * b;
        selectors.push_back(std::make_unique<SerialTwinCheck>(
            *MakeDecodeSelector(a, mc, shape, HeapKvAllocator()),
            *MakeDecodeSelector(a, mc, shape, HeapKvAllocator())));
        batch.push_back(DecodeInput{5 + b, len, caches.back().get(), selectors.back().get()});
      }
      std::vector<float> logits(static_cast<size_t>(bsz) * mc.vocab_size);
      for (int step = 0; step < 3; ++step) {
        ASSERT_TRUE((*model)->DecodeStep(batch, logits.data()).ok());
        for (DecodeInput& in : batch) ++in.position;
      }
      for (const auto& s : selectors) EXPECT_EQ(s->sparse_layers, 3 * mc.num_layers) << spec;
    }
  }
}

// Sparse attention over every token of every head, in order: the same sums as dense attention.
class AllTokensSelector : public DecodeSelector {
 public:
  absl::StatusOr<bool> Plan(int, const LayerCache& cache, int* num_indices) override {
    *num_indices = cache.len;
    return true;
  }
  void SelectHead(int, const float*, const LayerCache& cache, int, int32_t* out) override {
    std::iota(out, out + cache.len, 0);
  }
};

class ProbsRecorder : public DecodeObserver {
 public:
  void OnAttention(int seq, int layer, const float* probs, int len) override {
    got[{seq, layer}].assign(probs, probs + static_cast<size_t>(heads) * len);
  }
  int heads = 0;
  std::map<std::pair<int, int>, std::vector<float>> got;
};

// On a host backend the model selects and attends each sparse cache head in one task (on
// one-head views of the sequence); dense sequences go to one batched call. Selecting every
// token must then give dense attention's logits and probabilities bit for bit, in a batch that
// mixes sparse and dense sequences and caches kept per KV head and per query head: a view
// pointing at the wrong head's query, output, rows or probabilities would differ.
TEST(SparseAttention, HeadsAttendedAsSelectedEqualTheBatchedKernel) {
  for (const char* spec : {"synthetic:tiny,heads=8,kv_heads=2,head_dim=16",
                           "synthetic:tiny,heads=6,kv_heads=3,head_dim=16,dtype=bf16"}) {
    LoadOptions lo;
    lo.threads = 3;
    auto model = LlamaModel::Load(spec, lo);
    ASSERT_TRUE(model.ok()) << model.status();
    const ModelConfig& mc = (*model)->config();
    std::mt19937 rng(7);
    // Two copies of each sequence's cache: one decoded with the all-tokens selector (where
    // the sequence is sparse in the mixed batch), one densely.
    std::vector<std::unique_ptr<KvCache>> caches[2];
    std::vector<DecodeInput> batch[2];
    AllTokensSelector all_tokens;
    const bool sparse[] = {true, false, true, true, false};
    const bool per_query_head[] = {false, false, true, false, true};
    for (int b = 0; b < 5; ++b) {
      const int len = 40 + 23 * b;
      const int cache_heads = per_query_head[b] ? mc.num_heads : mc.num_kv_heads;
      KvCacheShape shape{cache_heads, mc.head_dim, (*model)->kv_dtype(),
                         std::vector<int>(mc.num_layers, len + 8)};
      std::vector<std::unique_ptr<KvCache>> layers;
      for (int l = 0; l < mc.num_layers; ++l) {
        layers.push_back(RandomCache(cache_heads, mc.head_dim, len, len + 8, shape.dtype, rng));
      }
      for (int copy = 0; copy < 2; ++copy) {
        caches[copy].push_back(*KvCache::Create(shape, HeapKvAllocator()));
        for (int l = 0; l < mc.num_layers; ++l) {
          CopyLayer(layers[l]->layer(0), &caches[copy].back()->layer(l));
        }
        DecodeSelector* selector = copy == 0 && sparse[b] ? &all_tokens : nullptr;
        batch[copy].push_back(DecodeInput{9 + b, len, caches[copy].back().get(), selector});
      }
    }
    std::vector<float> logits[2];
    ProbsRecorder probs[2];
    for (int step = 0; step < 3; ++step) {
      for (int copy = 0; copy < 2; ++copy) {
        logits[copy].assign(batch[copy].size() * mc.vocab_size, 0.f);
        probs[copy].heads = mc.num_heads;
        ASSERT_TRUE((*model)->DecodeStep(batch[copy], logits[copy].data(), &probs[copy]).ok());
        for (DecodeInput& in : batch[copy]) ++in.position;
      }
      ASSERT_EQ(logits[0], logits[1]) << spec << " step " << step;
      ASSERT_EQ(probs[0].got.size(), 5u * mc.num_layers);
      ASSERT_EQ(probs[0].got, probs[1].got) << spec << " step " << step;
    }
  }
}

// Counts what a selector takes, so the decode node's reservation can be checked against it.
class CountingAllocator : public KvAllocator {
 public:
  absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) override {
    total += bytes;
    return HeapKvAllocator().Allocate(bytes);
  }
  size_t total = 0;
};

// The decode node reserves DecodeSelectorBytes before it admits a request; the selector
// must take exactly that, in every mode.
TEST(SparseAttention, SelectorBytesAreWhatTheSelectorTakes) {
  const ModelConfig mc = Shape(8, 2, 64);
  const KvCacheShape shape{2, 64, DType::kBF16, {300}};
  for (AttentionMode mode : {AttentionMode::kDense, AttentionMode::kHybrid, AttentionMode::kQuest,
                             AttentionMode::kExactTopK}) {
    DecodeAttentionConfig a;
    a.mode = mode;
    if (mode != AttentionMode::kDense) a.token_budget = 64;
    CountingAllocator alloc;
    auto sel = MakeDecodeSelector(a, mc, shape, alloc);
    ASSERT_TRUE(sel.ok()) << AttentionModeName(mode) << ": " << sel.status();
    auto bytes = DecodeSelectorBytes(a, mc, shape);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(*bytes, alloc.total) << AttentionModeName(mode);
    // Dense takes nothing; a sparse mode its scores and indices (the device path's, in the
    // pool), and the modes that keep page summaries those too.
    EXPECT_EQ(*bytes > 0, mode != AttentionMode::kDense) << AttentionModeName(mode);
    if (mode == AttentionMode::kHybrid || mode == AttentionMode::kQuest) {
      auto p = ResolveSparseParams(a, 300, 64);
      ASSERT_TRUE(p.ok());
      EXPECT_GT(*bytes, PageSummaries::Bytes(shape, p->page_size)) << AttentionModeName(mode);
    }
  }
}

TEST(SparseAttention, HybridWithAllDimensionsAndUnitPagesIsExactTopK) {
  std::mt19937 rng(4);
  const ModelConfig mc = Shape(8, 2, 32);
  auto cache = RandomCache(2, 32, 150, 160, DType::kF32, rng);
  std::vector<float> q(8 * 32);
  std::normal_distribution<float> n(0.f, 1.f);
  for (float& x : q) x = n(rng);
  auto select = [&](AttentionMode mode) {
    DecodeAttentionConfig a;
    a.mode = mode;
    a.top_k = 40;
    if (mode == AttentionMode::kHybrid) {
      a.top_r = 32;
      a.page_size = 1;
    }
    auto sel = *MakeDecodeSelector(a, mc, cache->shape(), HeapKvAllocator());
    std::vector<int32_t> idx;
    int num = 0;
    EXPECT_TRUE(*sel->Select(0, q.data(), cache->layer(0), &idx, &num));
    std::set<int32_t> s0 = Selected(idx, 0, 40), s1 = Selected(idx, 1, 40);
    return std::make_pair(s0, s1);
  };
  EXPECT_EQ(select(AttentionMode::kHybrid), select(AttentionMode::kExactTopK));
}

TEST(SparseAttention, PageSummariesStayExactAcrossPageBoundaries) {
  std::mt19937 rng(3);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int page : {1, 3, 4}) {
      // 150 slots: up to 150 pages, as whole rows and in tiles of 64 pages (a short last one).
      for (int tile : {PageSummaries::kRows, PageSummaries::kTilePages}) {
        auto cache = RandomCache(2, 16, 5, 150, dtype, rng);
        const KvCacheShape shape = cache->shape();
        PageSummaries sums(shape, page,
                           *HeapKvAllocator().Allocate(PageSummaries::Bytes(shape, page)), 0, tile);
        // 2 heads × 16 dims × 150 slots: min and max rows per page, or, for pages of one token
        // (the keys themselves), one set.
        const size_t sets = page == 1 ? 1 : 2, pages = (150 + page - 1) / page;
        EXPECT_EQ(PageSummaries::Bytes(shape, page), 2 * sets * 16 * pages * DTypeSize(dtype));
        LayerCache& lc = cache->layer(0);
        for (int len = 5; len <= 150; len += len < 60 ? 1 : 7) {  // tokens appended
          lc.len = len;
          sums.Update(0, lc);
          for (int h = 0; h < 2; ++h) {
            for (int p = 0; p < sums.pages(len); ++p) {
              for (int i = 0; i < 16; ++i) {
                float lo = 1e30f, hi = -1e30f;
                for (int t = p * page; t < std::min(len, (p + 1) * page); ++t) {
                  lo = std::min(lo, RowOf(lc, h, t)[i]);
                  hi = std::max(hi, RowOf(lc, h, t)[i]);
                }
                ASSERT_EQ(sums.Value(0, h, false, i, p), lo) << "len " << len << " page " << p;
                ASSERT_EQ(sums.Value(0, h, true, i, p), hi) << "len " << len << " page " << p;
              }
            }
          }
        }
      }
    }
  }
}

TEST(SparseAttention, QuestBoundsEveryTokenOfItsPage) {
  std::mt19937 rng(5);
  auto cache = RandomCache(1, 16, 64, 64, DType::kF32, rng);
  PageSummaries sums(cache->shape(), 8,
                     *HeapKvAllocator().Allocate(PageSummaries::Bytes(cache->shape(), 8)));
  sums.Update(0, cache->layer(0));
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> q(16);
  for (float& x : q) x = n(rng);
  for (int p = 0; p < 8; ++p) {
    float bound = 0;
    for (int i = 0; i < 16; ++i) {
      bound += std::max(q[i] * sums.Value(0, 0, true, i, p), q[i] * sums.Value(0, 0, false, i, p));
    }
    for (int t = p * 8; t < p * 8 + 8; ++t) {
      const auto row = RowOf(cache->layer(0), 0, t);
      float dot = 0;
      for (int i = 0; i < 16; ++i) dot += q[i] * row[i];
      EXPECT_LE(dot, bound + 1e-5f);
    }
  }
}

TEST(SparseAttention, BudgetCoveringTheCacheIsDense) {
  auto model = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model.ok());
  std::vector<int32_t> prompt;
  for (int i = 0; i < 60; ++i) prompt.push_back(3 + (i * 11) % 300);
  GenerationRequest dense;
  dense.prompt_ids = prompt;
  dense.max_tokens = 12;
  dense.sampling.temperature = 0;
  auto want = Generate(**model, dense);
  ASSERT_TRUE(want.ok());
  for (AttentionMode mode :
       {AttentionMode::kHybrid, AttentionMode::kQuest, AttentionMode::kExactTopK}) {
    GenerationRequest r = dense;
    r.attention.mode = mode;
    r.attention.top_k = 200;  // more than the cache ever holds
    if (mode == AttentionMode::kHybrid) r.attention.top_r = (*model)->config().head_dim;
    auto got = Generate(**model, r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->ids, want->ids) << AttentionModeName(mode);
    EXPECT_EQ(got->logprobs, want->logprobs) << AttentionModeName(mode);
  }
}

TEST(SparseAttention, SparseDecodeRunsInsideTheModel) {
  auto model = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model.ok());
  GenerationRequest r;
  for (int i = 0; i < 200; ++i) r.prompt_ids.push_back(3 + (i * 11) % 300);
  r.max_tokens = 10;
  r.attention.mode = AttentionMode::kHybrid;
  r.attention.token_budget = 48;
  auto got = Generate(**model, r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->ids.size(), 10u);
  EXPECT_NE(got->attention.Describe().find("hybrid(t=48"), std::string::npos);
}

TEST(SparseAttention, RocketKVSplitsTheBudgetAsTheAuthorsCode) {
  // docs/algorithms.md §3.5: S = 32000 + 768, t = 512, d = 128.
  auto big = ResolveRocketKV(512, 32000, 768, 128, CompressionConfig{});
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->stage1.policy_name(), "snapkv_pp");
  EXPECT_EQ(big->stage1.budget, 2423);
  EXPECT_EQ(big->stage2.page_size, 3);
  EXPECT_EQ(big->stage2.top_r, 62);
  EXPECT_EQ(big->stage2.top_k, 256);
  // The stories scale: S = 400 + 64, t = 64, d = 8.
  auto small = ResolveRocketKV(64, 400, 64, 8, CompressionConfig{});
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->stage1.budget, 158);
  EXPECT_EQ(small->stage2.page_size, 2);
  EXPECT_EQ(small->stage2.top_r, 5);
  EXPECT_EQ(small->stage2.top_k, 32);
  EXPECT_FALSE(ResolveRocketKV(1, 100, 10, 8, CompressionConfig{}).ok());
  // The paper's own split (budget_split=sqrt): √c per stage, P = round(c^(1/4)).
  CompressionConfig paper;
  paper.policy = *MakePolicy("rocketkv", {{"budget_split", "sqrt"}, {"kernel_small", "31"}});
  paper.budget = 512;
  auto sqrt = ResolveRocketKV(512, 32000, 768, 128, paper);
  ASSERT_TRUE(sqrt.ok()) << sqrt.status();
  EXPECT_EQ(sqrt->stage1.budget, 4096 - 768);  // capacity S/√c = 4096 holds the 768 generated
  EXPECT_EQ(sqrt->stage1.policy->params().at("kernel_small"), "31");
  EXPECT_EQ(sqrt->stage2.page_size, 3);  // √8 = 2.83
  EXPECT_EQ(sqrt->stage2.top_r, 48);     // 128 · 3 / 8
  EXPECT_EQ(sqrt->stage2.top_k, 256);
}

// Layers the compression kept whole (skip_layers) attend densely at decode, and the sparse
// parameters are sized by the compressed layers (RocketKV's reference).
TEST(SparseAttention, LayersKeptWholeAttendDensely) {
  CompressionConfig c;
  c.policy = *MakePolicy("rocketkv");
  c.budget = 64;
  c.skip_layers = 1;
  DecodeAttentionConfig a;
  ASSERT_TRUE(ResolveTwoStage(&c, &a, 400, 64, 16).ok());
  EXPECT_EQ(a.mode, AttentionMode::kHybrid);
  EXPECT_EQ(a.dense_layers, 1);
  // A two-layer cache: layer 0 holds the whole prompt, layer 1 the compressed one.
  const ModelConfig mc = Shape(4, 2, 16);
  std::mt19937 rng(5);
  KvCacheShape shape{2, 16, DType::kF32, {464, c.budget + 64}};
  auto cache = *KvCache::Create(shape, HeapKvAllocator());
  for (int l = 0; l < 2; ++l) {
    auto one = RandomCache(2, 16, l == 0 ? 400 : c.budget, shape.capacity[l], DType::kF32, rng);
    LayerCache& dst = cache->layer(l);
    const LayerCache& src = one->layer(0);
    std::memcpy(dst.k, src.k, src.row_bytes() * 2 * src.capacity);
    std::memcpy(dst.v, src.v, src.row_bytes() * 2 * src.capacity);
    std::memcpy(dst.positions, src.positions, sizeof(int32_t) * 2 * src.capacity);
    dst.len = src.len;
  }
  CountingAllocator alloc;
  auto sel = MakeDecodeSelector(a, mc, cache->shape(), alloc);
  ASSERT_TRUE(sel.ok()) << sel.status();
  // No page summaries for the dense layer: the selector takes what one with every layer sparse
  // takes, less that layer's summaries.
  DecodeAttentionConfig all_sparse = a;
  all_sparse.dense_layers = 0;
  auto all_bytes = DecodeSelectorBytes(all_sparse, mc, shape);
  ASSERT_TRUE(all_bytes.ok()) << all_bytes.status();
  EXPECT_EQ(*all_bytes - alloc.total,
            PageSummaries::Bytes(shape, a.page_size) - PageSummaries::Bytes(shape, a.page_size, 1));
  std::vector<float> q(4 * 16, 0.5f);
  std::vector<int32_t> idx;
  int num = 0;
  EXPECT_FALSE(*(*sel)->Select(0, q.data(), cache->layer(0), &idx, &num)) << "dense";
  EXPECT_TRUE(*(*sel)->Select(1, q.data(), cache->layer(1), &idx, &num)) << "sparse";
}

TEST(SparseAttention, BytesReadCountSummaries) {
  SparseParams dense;
  EXPECT_EQ(BytesReadPerStep(dense, 1000, 128, DType::kBF16), 1000 * 2 * 128 * 2);
  SparseParams h{AttentionMode::kHybrid, 100, 32, 4};
  // 100 tokens of K and V, plus 250 pages x 32 dims of one summary each.
  EXPECT_EQ(BytesReadPerStep(h, 1000, 128, DType::kBF16), 100 * 2 * 128 * 2 + 250 * 32 * 2);
  SparseParams q{AttentionMode::kQuest, 100, 128, 16};
  EXPECT_EQ(BytesReadPerStep(q, 1000, 128, DType::kBF16), 100 * 2 * 128 * 2 + 63 * 2 * 128 * 2);
  // The budget t counts those reads: hybrid's parameters keep them near t tokens.
  DecodeAttentionConfig a;
  a.mode = AttentionMode::kHybrid;
  a.token_budget = 256;
  auto p = ResolveSparseParams(a, 8192, 128);
  ASSERT_TRUE(p.ok());
  const double tokens = BytesReadPerStep(*p, 8192, 128, DType::kBF16) / (2.0 * 128 * 2);
  EXPECT_NEAR(tokens, 256, 256 * 0.15);
}

// Over a coded cache (head_dim 128, bf16 residual): 1000 prompt tokens coded in 9 key groups
// (groups of 128 below the last 16 tokens, which are a group of their own), 10 appended
// tokens in the residual.
TEST(SparseAttention, BytesReadOverCodedCachesCountCodesGroupsAndResidual) {
  LayerCache l;
  l.n_heads = 1;
  l.head_dim = 128;
  l.dtype = DType::kBF16;
  l.len = 1010;
  l.coding.format = KvFormat::kInt4;
  l.coding.kept = 1000;
  // int4: a key row's codes 64 bytes, a value row's 64 and one {step, min} (4); 512 bytes of
  // parameters a group; a residual row 256 bytes of K and as many of V.
  const SparseParams dense;
  EXPECT_EQ(BytesReadPerStep(dense, l), 1000 * (64 + 68) + 9 * 512 + 10 * 2 * 256);
  EXPECT_EQ(BytesReadPerStep(dense, l), l.HeadBytes());
  // Hybrid, k = 100: 253 pages of 32 summary dims in bf16, the 10 residual rows, 90 coded rows
  // and at most 9 groups' parameters.
  const SparseParams h{AttentionMode::kHybrid, 100, 32, 4};
  EXPECT_EQ(BytesReadPerStep(h, l), 253 * 32 * 2 + 10 * 2 * 256 + 90 * (64 + 68) + 9 * 512);
  // Fewer chosen rows than groups: a group each at most.
  const SparseParams few{AttentionMode::kHybrid, 14, 32, 4};
  EXPECT_EQ(BytesReadPerStep(few, l), 253 * 32 * 2 + 10 * 2 * 256 + 4 * (64 + 68) + 4 * 512);
  // The exact oracle scores every key (codes, parameters, the residual's keys) and reads the
  // chosen rows' values.
  const SparseParams exact{AttentionMode::kExactTopK, 100, 128, 1};
  EXPECT_EQ(BytesReadPerStep(exact, l), 1000 * 64 + 9 * 512 + 10 * 256 + 90 * 68 + 10 * 256);
  // fp8: 128-byte rows and a value scale per group beside its parameters.
  l.coding.format = KvFormat::kFP8;
  EXPECT_EQ(BytesReadPerStep(dense, l), 1000 * (128 + 128) + 9 * (512 + 1) + 10 * 2 * 256);
  // The same cache in its dtype reads as BytesReadPerStep over its shape.
  l.coding.format = KvFormat::kAuto;
  EXPECT_EQ(BytesReadPerStep(h, l), BytesReadPerStep(h, 1010, 128, DType::kBF16));
}

TEST(SparseAttention, BadConfigsSayWhy) {
  DecodeAttentionConfig a;
  a.mode = AttentionMode::kHybrid;
  EXPECT_NE(std::string(a.Validate().message()).find("token_budget is needed by hybrid"),
            std::string::npos)
      << a.Validate();
  EXPECT_EQ(FieldOf(a.Validate()).value_or(""), "attention.token_budget");
  a.top_k = -1;
  EXPECT_EQ(a.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FieldOf(a.Validate()).value_or(""), "attention.top_k");
  EXPECT_FALSE(ParseAttentionMode("sparse").ok());
  EXPECT_EQ(*ParseAttentionMode("exact_topk"), AttentionMode::kExactTopK);
  // A parameter the mode does not take is refused, naming it.
  DecodeAttentionConfig q;
  q.mode = AttentionMode::kQuest;
  q.token_budget = 64;
  q.top_r = 4;
  EXPECT_NE(std::string(q.Validate().message()).find("top_r does not apply to quest"),
            std::string::npos)
      << q.Validate();
  EXPECT_EQ(FieldOf(q.Validate()).value_or(""), "attention.top_r");
  DecodeAttentionConfig d;
  d.token_budget = 64;
  EXPECT_NE(std::string(d.Validate().message()).find("token_budget does not apply to dense"),
            std::string::npos)
      << d.Validate();
}

}  // namespace
}  // namespace kvwire
