// The selection ops (kernels/selection.h) on every backend against the reference backend, the
// specification: scoring ops within float tolerance (or bit for bit where every backend sums
// in the reference's order), rankings and selections exactly, over awkward sizes, plateaus of
// equal scores, NaN and -0. Instantiated with BackendOpsTest (backend_ops_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/crc32c.h"
#include "common/base/ranking.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda_kernels_util.h"
#include "tests/kernels/ops_test_util.h"

namespace kvwire::kernels {
namespace {

// Scores with plateaus (a few distinct values), the shape max-pooling and pages give.
std::vector<float> Plateaus(size_t n, uint32_t seed, int levels = 5) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(0, levels - 1);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(level(rng)) / levels;
  return v;
}

// ---------------------------------------------------------------- prefill scoring

TEST_P(BackendOpsTest, WindowVotes) {
  uint32_t seed = 500;
  for (int len : {1, 7, 37, 733, 2100}) {
    for (int window : {1, 3, 16}) {
      if (window > len) continue;
      for (auto [heads, group] : std::vector<std::pair<int, int>>{{1, 1}, {4, 1}, {8, 4}, {8, 8}}) {
        for (VoteReduce reduce : {VoteReduce::kSum, VoteReduce::kMean, VoteReduce::kMax}) {
          const int prefix = std::max(1, len - window);
          SCOPED_TRACE(absl::StrCat("len=", len, " window=", window, " heads=", heads,
                                    " group=", group, " reduce=", static_cast<int>(reduce)));
          const auto scores = Random(static_cast<size_t>(heads) * window * len, seed++, 0.f, 1.f);
          auto run = [&](KernelBackend& b) {
            Arena a(b);
            WindowVotesParams p;
            p.scores = a.Upload(scores);
            p.n_heads = heads;
            p.window = window;
            p.len = len;
            p.prefix = prefix;
            p.group = group;
            p.reduce = reduce;
            p.votes = a.Filled(static_cast<size_t>(heads / group) * prefix, -7.f);
            const absl::Status st = b.WindowVotes(p);
            EXPECT_TRUE(st.ok()) << st;
            return a.Download(p.votes, static_cast<size_t>(heads / group) * prefix);
          };
          // Every backend sums in the reference's order: equal bit for bit.
          EXPECT_EQ(run(*backend_), run(*reference_));
        }
      }
    }
  }
}

TEST_P(BackendOpsTest, Pool1dAndRunMeans) {
  uint32_t seed = 600;
  for (int n : {1, 7, 37, 733, 5000}) {
    for (int kernel : {1, 3, 7, 63, 511}) {
      for (PoolKind kind : {PoolKind::kMax, PoolKind::kAvg}) {
        SCOPED_TRACE(absl::StrCat("n=", n, " kernel=", kernel, " kind=", static_cast<int>(kind)));
        const int rows = 3;
        // Plateaus and a NaN: max pooling is exact and skips NaN as std::max does.
        auto x = seed % 2 ? Plateaus(static_cast<size_t>(rows) * n, seed) : Random(rows * n, seed);
        ++seed;
        if (kind == PoolKind::kMax && n > 5) x[4] = std::numeric_limits<float>::quiet_NaN();
        auto run = [&](KernelBackend& b) {
          Arena a(b);
          Pool1dParams p{a.Upload(x), a.Filled<float>(x.size(), -7.f), rows, n, kernel, kind};
          const absl::Status st = b.Pool1d(p);
          EXPECT_TRUE(st.ok()) << st;
          return a.Download(p.y, x.size());
        };
        const auto got = run(*backend_), want = run(*reference_);
        if (kind == PoolKind::kMax) {
          EXPECT_TRUE(AllClose(got, want, {0.f, 0.f}));
        } else {
          EXPECT_TRUE(AllClose(got, want, {1e-6f, 1e-5f}));
        }
      }
    }
    for (int run_len : {1, 3, 10, 64}) {
      SCOPED_TRACE(absl::StrCat("n=", n, " run=", run_len));
      const auto x = Random(2 * static_cast<size_t>(n), seed++);
      const int runs = (n + run_len - 1) / run_len;
      auto run = [&](KernelBackend& b) {
        Arena a(b);
        RunMeansParams p{a.Upload(x), a.Filled<float>(2 * runs, -7.f), 2, n, run_len};
        const absl::Status st = b.RunMeans(p);
        EXPECT_TRUE(st.ok()) << st;
        return a.Download(p.y, 2 * runs);
      };
      EXPECT_EQ(run(*backend_), run(*reference_));  // each run summed in order
    }
  }
}

// ---------------------------------------------------------------- ranking

struct TopKCase {
  int n, run, k;
  bool tie;
};

// Whether the CUDA backend takes a TopK call of segments like these to FlashInfer's top-k
// (top_k.cu's FlashInferWidth): ranked by runs alone, best first, and at most 2048 runs asked
// of a row, ⌈k / run⌉ and one more where the last run is short.
bool RanksThroughFlashInfer(BackendKind kind, const std::vector<TopKSegment>& segs,
                            bool ascending) {
  if (kind != BackendKind::kCuda || !CudaRanksThroughFlashInfer() || ascending) return false;
  for (const TopKSegment& s : segs) {
    const int runs = (s.n + s.run - 1) / s.run;
    const int need = std::min(runs, (s.k + s.run - 1) / s.run + (s.n % s.run != 0 ? 1 : 0));
    if (s.tie != nullptr || need > 2048) return false;
  }
  return true;
}

TEST_P(BackendOpsTest, TopKRanksAsTheReferenceDoes) {
  // On cuda, best first without ties goes to FlashInfer's top-k: rows of 1, 2, 4 and 8 runs a
  // thread to order (k of 100, 300, 700 and 2048 runs), and past its 2048 (k of 2100) to CUB.
  const std::vector<TopKCase> cases = {
      {1, 1, 1, false},        {7, 1, 3, false},         {37, 1, 37, false},
      {733, 1, 100, false},    {733, 1, 733, true},      {733, 1, 64, true},
      {5000, 1, 700, true},    {37, 3, 10, false},       {733, 4, 128, false},
      {733, 16, 33, false},    {100, 7, 100, false},     {20000, 6, 512, false},
      {5000, 1, 300, false},   {5000, 1, 700, false},    {20000, 1, 2048, false},
      {20000, 1, 2100, false}, {20000, 16, 1024, false}, {30000, 7, 14000, false}};
  uint32_t seed = 700;
  for (bool ascending : {false, true}) {
    for (const TopKCase& c : cases) {
      SCOPED_TRACE(absl::StrCat("n=", c.n, " run=", c.run, " k=", c.k, " tie=", c.tie,
                                " ascending=", ascending));
      const int runs = (c.n + c.run - 1) / c.run;
      // Three segments in one call: plateaus, random scores with a NaN, -0 and +0 and -inf.
      std::vector<std::vector<float>> scores = {Plateaus(runs, seed), Random(runs, seed + 1),
                                                Plateaus(runs, seed + 2, 2)};
      if (runs > 4) {
        scores[1][1] = std::numeric_limits<float>::quiet_NaN();
        scores[1][2] = -0.f;
        scores[1][3] = 0.f;
        scores[2][0] = -std::numeric_limits<float>::infinity();
      }
      std::vector<std::vector<float>> ties = {Plateaus(c.n, seed + 3, 3), Random(c.n, seed + 4),
                                              Plateaus(c.n, seed + 5, 2)};
      seed += 6;
      auto run = [&](KernelBackend& b) {
        Arena a(b);
        std::vector<TopKSegment> segs(scores.size());
        for (size_t i = 0; i < segs.size(); ++i) {
          segs[i].score = a.Upload(scores[i]);
          segs[i].tie = c.tie ? a.Upload(ties[i]) : nullptr;
          segs[i].n = c.n;
          segs[i].run = c.run;
          segs[i].k = c.k - static_cast<int>(i % 2);  // segments of different k
          if (segs[i].k < 1) segs[i].k = 1;
          segs[i].append = static_cast<int>(i);  // the window after the k chosen
          segs[i].out = a.Filled<int32_t>(c.k + 2, -1);
        }
        const int64_t library = FlashInferTopKLaunchesHere();
        const absl::Status st = b.TopK({segs.data(), static_cast<int>(segs.size()), ascending});
        EXPECT_TRUE(st.ok()) << st;
        if (&b == backend_.get()) {
          EXPECT_EQ(FlashInferTopKLaunchesHere() - library,
                    RanksThroughFlashInfer(GetParam(), segs, ascending) ? 1 : 0);
        }
        std::vector<std::vector<int32_t>> out;
        for (const TopKSegment& s : segs) out.push_back(a.DownloadAs(s.out, c.k + 2));
        return out;
      };
      const auto got = run(*backend_), want = run(*reference_);
      EXPECT_EQ(got, want);
      // The reference itself, run 1 without ties: the order of common/base/ranking.h.
      if (c.run == 1 && !c.tie) {
        std::vector<int32_t> full = RankBestFirst(scores[0]);
        full.resize(c.k);
        if (ascending) std::sort(full.begin(), full.end());
        EXPECT_EQ(std::vector<int32_t>(want[0].begin(), want[0].begin() + c.k), full);
      }
      // Segment 2 (k - 0) appends n, n + 1 after its k.
      EXPECT_EQ(want[2][c.k], c.n);
      EXPECT_EQ(want[2][c.k + 1], c.n + 1);
    }
  }
}

// Where the k best reach the scores of −∞ and NaN, every −∞ comes before any NaN, each by
// index (FlashInfer's top-k sees the two alike, and top_k.cu chooses among them again): runs
// of 1 and of 4 with a short last one, NaN at lower indices than −∞, a second segment of
// another k in the same call, and finite scores with −0 and +0.
TEST_P(BackendOpsTest, TopKTakesMinusInfinityBeforeNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (int run : {1, 4}) {
    for (int k_low : {1, 3, 7}) {  // how many items the k take from the −∞ and NaN runs
      SCOPED_TRACE(absl::StrCat("run=", run, " k_low=", k_low));
      // Runs 0-4 NaN, 5-9 −∞, 10-39 finite (plateaus of 5, a −0 beside +0s).
      std::vector<float> scores(40);
      for (int i = 0; i < 40; ++i) scores[i] = i < 5 ? nan : i < 10 ? -inf : (i % 5) * 0.25f;
      scores[12] = -0.f;
      const int n = run == 1 ? 40 : 40 * run - 2;  // the last run 2 items long
      const int finite_items = run == 1 ? 30 : 30 * run - 2;
      const std::vector<float> other = Plateaus(40, 9, 3);
      auto go = [&](KernelBackend& b) {
        Arena a(b);
        std::vector<TopKSegment> segs(2);
        segs[0] = {a.Upload(scores), nullptr, n, run, finite_items + k_low, 2, nullptr};
        segs[1] = {a.Upload(other), nullptr, n, run, 5, 0, nullptr};
        for (TopKSegment& s : segs) s.out = a.Filled<int32_t>(s.k + s.append, -1);
        const absl::Status st = b.TopK({segs.data(), 2, /*ascending=*/false});
        EXPECT_TRUE(st.ok()) << st;
        return std::vector<std::vector<int32_t>>{a.DownloadAs(segs[0].out, segs[0].k + 2),
                                                 a.DownloadAs(segs[1].out, 5)};
      };
      const auto want = go(*reference_);
      EXPECT_EQ(go(*backend_), want);
      // The reference: the finite items, then the −∞ runs' items (5 to 9), then NaN's (0 to 4).
      for (int t = 0; t < k_low; ++t) {
        EXPECT_EQ(want[0][finite_items + t], t < 5 * run ? 5 * run + t : t - 5 * run);
      }
    }
  }
}

// Rows where more than 16K scores tie at the cut (FlashInfer's top-k then rescans the row, its
// buffer of candidates full): all equal but a few, and 17000 runs of which the k best reach far
// into 16700 of −∞ and NaN (FlashInfer sees those alike); blocks ordering 256 to 2048 runs.
TEST_P(BackendOpsTest, TopKWhereThousandsTie) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    int runs, run, k;
    bool low;  // the −∞ and NaN row, else all equal but a few
  };
  for (const Case& c : std::vector<Case>{{20000, 1, 100, false},
                                         {40000, 1, 2048, false},
                                         {17000, 1, 400, true},
                                         {17000, 3, 2900, true}}) {
    SCOPED_TRACE(absl::StrCat("runs=", c.runs, " run=", c.run, " k=", c.k, " low=", c.low));
    std::vector<float> scores(c.runs, 0.5f);
    if (c.low) {
      for (int i = 0; i < 16700; ++i) scores[i] = i < 8000 ? nan : -inf;
      for (int i = 16700; i < c.runs; ++i) scores[i] = static_cast<float>(i % 7);
    } else {
      for (int i = 0; i < 30; ++i) scores[(i * 7919) % c.runs] = 1.f + i;
    }
    const int n = c.runs * c.run - (c.run > 1 ? 1 : 0);  // a short last run where runs are
    auto go = [&](KernelBackend& b) {
      Arena a(b);
      TopKSegment seg{a.Upload(scores), nullptr, n, c.run, c.k, 1, nullptr};
      seg.out = a.Filled<int32_t>(c.k + 1, -1);
      const int64_t library = FlashInferTopKLaunchesHere();
      const absl::Status st = b.TopK({&seg, 1, /*ascending=*/false});
      EXPECT_TRUE(st.ok()) << st;
      if (&b == backend_.get()) {
        EXPECT_EQ(FlashInferTopKLaunchesHere() - library,
                  RanksThroughFlashInfer(GetParam(), {seg}, false) ? 1 : 0);
      }
      return a.DownloadAs(seg.out, c.k + 1);
    };
    const auto want = go(*reference_);
    EXPECT_EQ(go(*backend_), want);
    if (c.low) {  // after the 300 finite runs' items, −∞'s from run 8000 on
      EXPECT_EQ(want[300 * c.run - (c.run > 1 ? 1 : 0)], 8000 * c.run);
    }
  }
}

TEST_P(BackendOpsTest, HbwSelect) {
  uint32_t seed = 800;
  struct Case {
    int prefix, block, budget;
    std::vector<int> rounds;
  };
  const std::vector<Case> cases = {{37, 3, 12, {1, 8}}, {733, 5, 200, {1, 8}},
                                   {733, 4, 733, {1}},  {5000, 16, 1000, {1, 4, 8}},
                                   {100, 7, 51, {3}},   {64, 1, 10, {64}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("prefix=", c.prefix, " block=", c.block, " budget=", c.budget));
    const int blocks = (c.prefix + c.block - 1) / c.block, rows = 3;
    const auto scores = Plateaus(static_cast<size_t>(rows) * blocks, seed++, 4);
    auto run = [&](KernelBackend& b) {
      Arena a(b);
      HbwSelectParams p;
      p.block_scores = a.Upload(scores);
      p.rows = rows;
      p.prefix = c.prefix;
      p.block = c.block;
      p.prefix_budget = c.budget;
      p.append = 3;  // a window of 3 after the prefix
      for (int r : c.rounds) p.rounds[p.n_rounds++] = r;
      p.out = a.Filled<int32_t>(static_cast<size_t>(rows) * (c.budget + 3), -1);
      const absl::Status st = b.HbwSelect(p);
      EXPECT_TRUE(st.ok()) << st;
      return a.DownloadAs(p.out, static_cast<size_t>(rows) * (c.budget + 3));
    };
    const auto got = run(*backend_), want = run(*reference_);
    EXPECT_EQ(got, want);
    const int stride = c.budget + 3;
    for (int r = 0; r < rows; ++r) {  // budget distinct positions, ascending, then the window
      const auto row =
          std::vector<int32_t>(want.begin() + r * stride, want.begin() + (r + 1) * stride);
      EXPECT_TRUE(std::is_sorted(row.begin(), row.end()));
      EXPECT_EQ(std::adjacent_find(row.begin(), row.end()), row.end());
      EXPECT_GE(row.front(), 0);
      EXPECT_LT(row[c.budget - 1], c.prefix);
      EXPECT_EQ(row.back(), c.prefix + 2);
    }
  }
}

TEST_P(BackendOpsTest, GatherKv) {
  uint32_t seed = 900;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [kv_heads, cache_heads] : std::vector<std::pair<int, int>>{{1, 1}, {2, 2}, {2, 8}}) {
      for (int d : {8, 64, 128}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(t), " heads=", kv_heads, "/", cache_heads, " d=", d));
        const int len = 37, count = 11;
        const int64_t stride = int64_t{kv_heads} * d * 3 + 5;  // a q|k|v row and padding
        const auto qkv = Random(static_cast<size_t>(len) * stride, seed++, -3.f, 3.f);
        std::vector<int32_t> kept;
        std::mt19937 rng(seed++);
        for (int c = 0; c < cache_heads; ++c) {
          std::vector<int32_t> all(len);
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng);
          std::sort(all.begin(), all.begin() + count);
          kept.insert(kept.end(), all.begin(), all.begin() + count);
        }
        auto run = [&](KernelBackend& b) {
          Arena a(b);
          const float* base = a.Upload(qkv);
          GatherKvParams p;
          p.k = base + kv_heads * d;
          p.v = base + 2 * kv_heads * d;
          p.kv_stride = stride;
          p.kept = a.Upload(kept);
          p.len = len;
          p.n_cache_heads = cache_heads;
          p.n_kv_heads = kv_heads;
          p.head_dim = d;
          p.count = count;
          p.dtype = t;
          const size_t bytes = static_cast<size_t>(cache_heads) * count * d * DTypeSize(t);
          p.k_out = a.Filled<uint8_t>(bytes, 0xAB);
          p.v_out = a.Filled<uint8_t>(bytes, 0xCD);
          const absl::Status st = b.GatherKv(p);
          EXPECT_TRUE(st.ok()) << st;
          auto out = a.DownloadBytes(p.k_out, bytes);
          const auto v = a.DownloadBytes(p.v_out, bytes);
          out.insert(out.end(), v.begin(), v.end());
          return out;
        };
        EXPECT_EQ(run(*backend_), run(*reference_));  // one rounding per element
      }
    }
  }
}

// ---------------------------------------------------------------- page summaries, scores

struct SummaryCase {
  int heads, capacity, page, tile_pages;
  DType dtype;
};

std::vector<SummaryCase> SummaryCases() {
  std::vector<SummaryCase> cases;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    cases.push_back({2, 37, 1, 1 << 30, t});
    cases.push_back({3, 733, 4, 1 << 30, t});
    cases.push_back({2, 733, 5, 64, t});
    cases.push_back({1, 2000, 16, 8, t});
  }
  return cases;
}

TEST_P(BackendOpsTest, UpdateSummariesRecomputesThePagesOfNewTokens) {
  uint32_t seed = 1000;
  for (const SummaryCase& c : SummaryCases()) {
    for (int d : {8, 64}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(c.dtype), " heads=", c.heads, " capacity=", c.capacity,
                                " page=", c.page, " tile=", c.tile_pages, " d=", d));
      const int64_t hs = int64_t{c.capacity} * d;
      const auto k = Encode(Random(c.heads * hs, seed++, -2.f, 2.f), c.dtype);
      SummaryLayout l{d, c.page, c.tile_pages, (c.capacity + c.page - 1) / c.page, c.dtype};
      const size_t bytes = static_cast<size_t>(c.heads) * l.head_elems() * DTypeSize(c.dtype);
      // Two updates: the prompt, then a few appended tokens (the last page recomputed).
      const int first_len = c.capacity - 7, second_len = c.capacity - 2;
      auto run = [&](KernelBackend& b) {
        Arena a(b);
        SummaryUpdateSegment s{a.Upload(k), KvLayout::Region(hs),        {}, c.heads, 0,
                               first_len,   a.Filled<uint8_t>(bytes, 0), l};
        EXPECT_TRUE(b.UpdateSummaries({&s, 1}).ok());
        s.first = first_len;
        s.len = second_len;
        EXPECT_TRUE(b.UpdateSummaries({&s, 1}).ok());
        return a.DownloadBytes(s.summaries, bytes);
      };
      const auto got = run(*backend_), want = run(*reference_);
      EXPECT_EQ(got, want);
      // The reference itself: head 0's max of dimension 1 over page 0 is the largest of its
      // tokens' values.
      std::vector<float> k0(static_cast<size_t>(c.page) * d);
      ToFloat(c.dtype, k.data(), k0.data(), k0.size());
      float hi = -INFINITY, lo = INFINITY;
      for (int t = 0; t < c.page; ++t) {
        hi = std::max(hi, k0[t * d + 1]);
        lo = std::min(lo, k0[t * d + 1]);
      }
      float stored;
      ToFloat(c.dtype, want.data() + l.Offset(c.page > 1, 1, 0) * DTypeSize(c.dtype), &stored, 1);
      EXPECT_EQ(stored, c.page > 1 ? hi : lo);
    }
  }
}

TEST_P(BackendOpsTest, PageScores) {
  uint32_t seed = 1100;
  for (const SummaryCase& c : SummaryCases()) {
    for (int group : {1, 4}) {
      for (PageScoreKind kind :
           {PageScoreKind::kHybrid, PageScoreKind::kQuest, PageScoreKind::kExact}) {
        const int d = 64;
        SCOPED_TRACE(absl::StrCat(DTypeName(c.dtype), " capacity=", c.capacity, " page=", c.page,
                                  " tile=", c.tile_pages, " group=", group,
                                  " kind=", static_cast<int>(kind)));
        const int64_t hs = int64_t{c.capacity} * d;
        const auto k = Encode(Random(c.heads * hs, seed++, -2.f, 2.f), c.dtype);
        const auto q = Random(static_cast<size_t>(c.heads) * group * d, seed++, -2.f, 2.f);
        SummaryLayout l{d, c.page, c.tile_pages, (c.capacity + c.page - 1) / c.page, c.dtype};
        const size_t bytes = static_cast<size_t>(c.heads) * l.head_elems() * DTypeSize(c.dtype);
        const int len = c.capacity - 3;  // a short last page
        const int n_scores = kind == PageScoreKind::kExact ? len : l.pages(len);
        auto run = [&](KernelBackend& b) {
          Arena a(b);
          const uint8_t* kd = a.Upload(k);
          uint8_t* sums = a.Filled<uint8_t>(bytes, 0);
          SummaryUpdateSegment u{kd, KvLayout::Region(hs), {}, c.heads, 0, len, sums, l};
          EXPECT_TRUE(b.UpdateSummaries({&u, 1}).ok());
          const float* qd = a.Upload(q);
          std::vector<PageScoreSegment> segs(c.heads);
          for (int h = 0; h < c.heads; ++h) {
            PageScoreSegment& s = segs[h];
            s.kind = kind;
            s.q = qd + static_cast<int64_t>(h) * group * d;
            s.group = group;
            s.len = len;
            s.summaries = sums + h * l.head_elems() * DTypeSize(c.dtype);
            s.layout = l;
            s.top_r = h == 0 ? d : 1 + 5 * h;
            s.k = kd;
            s.kv = KvLayout::Region(hs);
            s.head = h;
            s.scale = 0.125f;
            s.score = a.Filled<float>(n_scores, -7.f);
          }
          const absl::Status st =
              b.PageScores({segs.data(), static_cast<int>(segs.size()), d, c.dtype});
          EXPECT_TRUE(st.ok()) << st;
          std::vector<float> out;
          for (const PageScoreSegment& s : segs) {
            const auto one = a.Download(s.score, n_scores);
            out.insert(out.end(), one.begin(), one.end());
          }
          return out;
        };
        EXPECT_TRUE(AllClose(run(*backend_), run(*reference_), {1e-6f, 2e-4f}));
      }
    }
  }
}

// ---------------------------------------------------------------- sampling

// Sample on `b` over `logits` ([rows, vocab], stride vocab + 3): one token a row.
std::vector<SampledToken> SampleOn(KernelBackend& b, const std::vector<float>& logits, int vocab,
                                   const std::vector<SampleRow>& rows) {
  Arena a(b);
  SampleParams p;
  p.logits = a.Upload(logits);
  p.stride = vocab + 3;
  p.batch = static_cast<int>(rows.size());
  p.vocab = vocab;
  p.rows = rows.data();
  p.out = static_cast<SampledToken*>(
      static_cast<void*>(a.Filled<uint8_t>(sizeof(SampledToken) * rows.size(), 0xFF)));
  const absl::Status st = b.Sample(p);
  EXPECT_TRUE(st.ok()) << st;
  return a.DownloadAs(p.out, rows.size());
}

// Rows that cycle through `params`, three of each, each with its own uniform draw.
std::vector<SampleRow> SampleRows(const std::vector<SamplingParams>& params, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<SampleRow> rows(params.size() * 3);
  for (size_t b = 0; b < rows.size(); ++b) {
    rows[b].params = params[b % params.size()];
    rows[b].uniform = static_cast<double>(rng() >> 11) * 0x1.0p-53;
  }
  return rows;
}

void ExpectSameTokens(const std::vector<SampledToken>& got, const std::vector<SampledToken>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t b = 0; b < got.size(); ++b) {
    EXPECT_EQ(got[b].id, want[b].id) << "row " << b;
    if (std::isnan(want[b].logprob)) {
      EXPECT_TRUE(std::isnan(got[b].logprob)) << "row " << b;
    } else {
      EXPECT_NEAR(got[b].logprob, want[b].logprob, 1e-4f) << "row " << b;
    }
  }
}

TEST_P(BackendOpsTest, SampleDrawsTheReferenceToken) {
  uint32_t seed = 1200;
  const std::vector<SamplingParams> params = {{0.f, 0, 1.f},   {1.f, 0, 1.f},   {0.7f, 40, 1.f},
                                              {1.2f, 0, 0.9f}, {0.8f, 5, 0.5f}, {2.f, 1, 1.f}};
  for (int vocab : {1, 7, 733, 32000}) {
    SCOPED_TRACE(absl::StrCat("vocab=", vocab));
    const std::vector<SampleRow> rows = SampleRows(params, seed++);
    auto logits = Random(rows.size() * (vocab + 3), seed++, -8.f, 8.f);
    // Ties for the greedy rule: the lowest id of a repeated maximum.
    if (vocab > 5) logits[2] = logits[4] = 20.f;
    const auto want = SampleOn(*reference_, logits, vocab, rows);
    ExpectSameTokens(SampleOn(*backend_, logits, vocab, rows), want);
    if (vocab > 5) {
      EXPECT_EQ(want[0].id, 2);  // greedy: the first of the tied maxima
    }
  }
}

// Every sampling row with a top-k (1 to 2048, beside greedy rows): on cuda the candidates come
// from FlashInfer's top-k rather than a sort of the vocabulary, ordered by CUB's block sort for
// up to 256, 512, 1024 and 2048 of them. Logits on a few levels, so that many candidates tie
// and the lower id must come first; one row with +∞ logits, whose probabilities are NaN (last
// in the ranking order, which FlashInfer cannot rank a float below −∞ to) and +0 elsewhere.
TEST_P(BackendOpsTest, SampleWithATopKDrawsTheReferenceToken) {
  uint32_t seed = 1300;
  for (int top : {200, 500, 1000, 2048}) {
    const std::vector<SamplingParams> params = {{0.f, 0, 1.f},     {1.f, 1, 1.f},
                                                {0.7f, 40, 1.f},   {0.8f, 5, 0.5f},
                                                {1.2f, top, 0.9f}, {1.f, top, 1.f}};
    for (int vocab : {7, 733, 32000, 128256}) {
      SCOPED_TRACE(absl::StrCat("top=", top, " vocab=", vocab));
      const std::vector<SampleRow> rows = SampleRows(params, seed++);
      std::vector<float> logits = Plateaus(rows.size() * (vocab + 3), seed++, 7);
      for (float& x : logits) x = 6.f * x - 2.f;
      for (int i : {5, 50, 500}) {  // row 10 samples with top-k `top`
        if (i < vocab) logits[10 * (vocab + 3) + i] = std::numeric_limits<float>::infinity();
      }
      const int64_t library = FlashInferTopKLaunchesHere();
      const auto got = SampleOn(*backend_, logits, vocab, rows);
      EXPECT_EQ(FlashInferTopKLaunchesHere() - library,
                GetParam() == BackendKind::kCuda && CudaRanksThroughFlashInfer() ? 1 : 0);
      const auto want = SampleOn(*reference_, logits, vocab, rows);
      ExpectSameTokens(got, want);
      // Row 10: every finite logit's probability +0 and the mass 0, so the walk ends on the
      // last of the top-k: the +0 ids in order, then the NaN ids (5, 50, 500).
      std::vector<int32_t> order;
      for (int pass = 0; pass < 2; ++pass) {
        for (int i = 0; i < vocab; ++i) {
          const bool infinite = i == 5 || i == 50 || i == 500;
          if (infinite == (pass == 1)) order.push_back(i);
        }
      }
      EXPECT_EQ(want[10].id, order[std::min(top, vocab) - 1]);
    }
  }
}

TEST_P(BackendOpsTest, SelectionOpsRejectBadShapes) {
  Arena a(*backend_);
  float* f = a.Filled<float>(64, 0.f);
  int32_t* i = a.Filled<int32_t>(64, 0);
  WindowVotesParams wv{f, 4, 2, 8, 6, 3, VoteReduce::kSum, f};  // group 3 does not divide 4
  EXPECT_EQ(backend_->WindowVotes(wv).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Pool1d({f, f + 32, 1, 8, 4, PoolKind::kMax}).code(),  // an even kernel
            absl::StatusCode::kInvalidArgument);
  TopKSegment seg{f, nullptr, 8, 1, 9, 0, i};  // k above n
  EXPECT_EQ(backend_->TopK({&seg, 1, false}).code(), absl::StatusCode::kInvalidArgument);
  seg = {f, f, 8, 2, 4, 0, i};  // tie scores with runs
  EXPECT_EQ(backend_->TopK({&seg, 1, false}).code(), absl::StatusCode::kInvalidArgument);
  HbwSelectParams hbw;
  hbw.block_scores = f;
  hbw.rows = 1;
  hbw.prefix = 8;
  hbw.block = 2;
  hbw.prefix_budget = 9;  // above the prefix
  hbw.n_rounds = 1;
  hbw.rounds[0] = 1;
  hbw.out = i;
  EXPECT_EQ(backend_->HbwSelect(hbw).code(), absl::StatusCode::kInvalidArgument);
  SampleRow row;
  row.params.top_p = 0.f;  // top_p must be in (0, 1]
  SampledToken* out = static_cast<SampledToken*>(static_cast<void*>(i));
  EXPECT_EQ(backend_->Sample({f, 0, 1, 8, &row, out}).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- transports

// The CRC-32C of spans of backend memory (what a transport that writes a cache in place checks
// it by): every backend equals the reference's bitwise CRC, and the host's Crc32c, over spans
// of awkward lengths and offsets, empty ones and one past a page.
TEST_P(BackendOpsTest, ChecksumSpansEqualTheHostsCrc) {
  std::mt19937 rng(1300);
  std::vector<uint8_t> bytes(70000);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<std::pair<int64_t, int64_t>> at = {{0, 0},     {0, 1},    {1, 7},     {3, 64},
                                                 {100, 255}, {4093, 9}, {5, 65536}, {69999, 1}};
  for (int i = 0; i < 300; ++i) at.push_back({static_cast<int64_t>(rng() % 60000), rng() % 513});
  auto run = [&](KernelBackend& b) {
    Arena a(b);
    const uint8_t* base = a.Upload(bytes);
    std::vector<ByteSpan> spans;
    for (auto [off, n] : at) spans.push_back({base + off, n});
    std::vector<uint32_t> out(spans.size(), 0xdeadbeef);
    const absl::Status st =
        b.ChecksumSpans({spans.data(), static_cast<int>(spans.size()), out.data()});
    EXPECT_TRUE(st.ok()) << st;
    return out;
  };
  const std::vector<uint32_t> got = run(*backend_);
  EXPECT_EQ(got, run(*reference_));
  for (size_t i = 0; i < at.size(); ++i) {
    EXPECT_EQ(got[i], Crc32c(bytes.data() + at[i].first, static_cast<size_t>(at[i].second)))
        << "span " << i;
  }
  EXPECT_EQ(Crc32cBitwise(reinterpret_cast<const uint8_t*>("123456789"), 9), 0xE3069283u);
  // A negative length, and spans without out.
  ByteSpan bad{bytes.data(), -1};
  uint32_t out = 0;
  EXPECT_EQ(reference_->ChecksumSpans({&bad, 1, &out}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->ChecksumSpans({&bad, 1, nullptr}).code(), absl::StatusCode::kInvalidArgument);
}

// Device memory one backend exports and another maps (the cuda_ipc transport; the guarded
// backend emulates it with a memfd mapped twice): what either writes, the other reads, each
// through its own mapping; the exporter cannot import its own handle, a host backend exports
// nothing, and a closed import is gone from the importer. CUDA IPC needs two processes: on cuda
// this runs in the service pair's cluster test, not here.
TEST_P(BackendOpsTest, ExportedMemoryIsMappedByAnotherBackend) {
  if (GetParam() != BackendKind::kGuarded) {
    const auto st = backend_->ExportMemory(nullptr, 1).status();
    if (backend_->host_addressable()) {
      EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
    }
    GTEST_SKIP() << "export and import in one process are emulated by the guarded backend only";
  }
  auto peer = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(peer.ok()) << peer.status();
  Arena a(*backend_);
  uint8_t* slab = a.Filled<uint8_t>(10048, 7);
  auto handle = backend_->ExportMemory(slab, 10048);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(backend_->ImportMemory(*handle, 10048).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE((*peer)->ImportMemory(*handle, 10049).ok());  // more than was exported
  EXPECT_FALSE((*peer)->ImportMemory("guarded-ipc:nothing", 1).ok());
  auto mapped = (*peer)->ImportMemory(*handle, 10048);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  auto* m = static_cast<uint8_t*>(*mapped);
  // The slab's bytes, seen through the peer; a write through the peer, seen by the owner.
  std::vector<uint8_t> seen(10048);
  ASSERT_TRUE((*peer)->CopyToHost(seen.data(), m, seen.size()).ok());
  EXPECT_EQ(seen, std::vector<uint8_t>(10048, 7));
  const std::vector<uint8_t> hello = {1, 2, 3, 4};
  ASSERT_TRUE((*peer)->CopyToDevice(m + 10044, hello.data(), 4).ok());
  ASSERT_TRUE((*peer)->Synchronize().ok());
  EXPECT_EQ(a.DownloadBytes(slab + 10044, 4), hello);
  // The peer's ops see the mapping as its memory, up to its end and not past it.
  std::vector<ByteSpan> spans = {{m + 9000, 1048}};
  uint32_t out = 0;
  ASSERT_TRUE((*peer)->ChecksumSpans({spans.data(), 1, &out}).ok());
  std::vector<uint8_t> tail(1048, 7);
  std::copy(hello.begin(), hello.end(), tail.end() - 4);
  EXPECT_EQ(out, Crc32c(tail.data(), tail.size()));
  spans[0].bytes = 1049;
  EXPECT_EQ((*peer)->ChecksumSpans({spans.data(), 1, &out}).code(),
            absl::StatusCode::kInvalidArgument);
  (*peer)->CloseImported(m);
  spans[0].bytes = 1;
  EXPECT_EQ((*peer)->ChecksumSpans({spans.data(), 1, &out}).code(),
            absl::StatusCode::kInvalidArgument);
}

// A chunk's scattered rows to one buffer and back (the nccl transport's message), as the
// reference moves them: aligned and unaligned spans, empty ones, one of 64 KiB.
TEST_P(BackendOpsTest, PackSpansMoveBytesAsTheReference) {
  std::mt19937 rng(1301);
  std::vector<uint8_t> bytes(200000);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  // Disjoint spans in a shuffled order: [off, n) with gaps between.
  std::vector<std::pair<int64_t, int64_t>> at;
  for (int64_t off = 0; off + 70000 < 200000;) {
    const int64_t n = at.size() == 5 ? 65536 : (at.size() % 7 == 0 ? 0 : 1 + rng() % 300);
    at.push_back({off, n});
    off += n + (rng() % 3 == 0 ? 16 : rng() % 40);
  }
  std::shuffle(at.begin(), at.end(), rng);
  int64_t total = 0;
  for (auto [off, n] : at) total += n;
  auto run = [&](KernelBackend& b) {
    Arena a(b);
    uint8_t* base = a.Upload(bytes);
    std::vector<ByteSpan> spans;
    for (auto [off, n] : at) spans.push_back({base + off, n});
    uint8_t* packed = a.Filled<uint8_t>(static_cast<size_t>(total), 0);
    const int n = static_cast<int>(spans.size());
    absl::Status st = b.PackSpans({spans.data(), n, packed, false});
    EXPECT_TRUE(st.ok()) << st;
    std::vector<uint8_t> out = a.DownloadBytes(packed, static_cast<size_t>(total));
    // Unpacked into a zeroed copy: the spans' bytes come back, the gaps stay zero.
    uint8_t* back = a.Filled<uint8_t>(bytes.size(), 0);
    for (ByteSpan& sp : spans) sp.data = back + (sp.data - base);
    st = b.PackSpans({spans.data(), n, packed, true});
    EXPECT_TRUE(st.ok()) << st;
    return std::make_pair(out, a.DownloadBytes(back, bytes.size()));
  };
  const auto got = run(*backend_);
  EXPECT_EQ(got, run(*reference_));
  std::vector<uint8_t> want, unpacked(bytes.size(), 0);
  for (auto [off, n] : at) {
    want.insert(want.end(), bytes.begin() + off, bytes.begin() + off + n);
    std::copy_n(bytes.begin() + off, n, unpacked.begin() + off);
  }
  EXPECT_EQ(got.first, want);
  EXPECT_EQ(got.second, unpacked);
  ByteSpan bad{bytes.data(), -1};
  EXPECT_EQ(backend_->PackSpans({&bad, 1, bytes.data(), false}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reference_->PackSpans({&bad, 0, nullptr, false}).code(), absl::StatusCode::kOk);
}

// Two ends of a link between backends (the nccl transport): bytes sent from one backend's
// memory land in the other's, in order, sizes checked; a receive nobody sends to times out
// and aborts the link; an abort reaches the peer; offers that are not one are refused. On
// cuda NCCL would need a second GPU: the guarded backend's emulation runs here, and the host
// backends have none.
TEST_P(BackendOpsTest, LinkMovesBytesBetweenBackends) {
  std::string offer;
  if (GetParam() != BackendKind::kGuarded) {
    const auto st = backend_->OpenLink(&offer).status();
    if (backend_->host_addressable()) {
      EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
      EXPECT_EQ(backend_->JoinLink("x").status().code(), absl::StatusCode::kUnimplemented);
    } else {
      // NCCL loads, or is named as missing; its two ranks need two GPUs.
      EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kFailedPrecondition) << st;
      EXPECT_EQ(backend_->JoinLink("nccl:00").status().code(), absl::StatusCode::kInvalidArgument);
    }
    GTEST_SKIP() << "links run between two GPUs (NCCL), or on the guarded backend's emulation";
  }
  auto peer = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto open = backend_->OpenLink(&offer);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ((*peer)->JoinLink("socket-link:1:zz").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*peer)->JoinLink(offer + "0").status().code(), absl::StatusCode::kInvalidArgument);
  auto join = (*peer)->JoinLink(offer);
  ASSERT_TRUE(join.ok()) << join.status();
  Arena a(*backend_), b(**peer);
  std::vector<uint8_t> first(100000), second(37);
  for (size_t i = 0; i < first.size(); ++i) first[i] = static_cast<uint8_t>(i * 7 + 1);
  for (size_t i = 0; i < second.size(); ++i) second[i] = static_cast<uint8_t>(200 - i);
  const uint8_t* src1 = a.Upload(first);
  const uint8_t* src2 = a.Upload(second);
  uint8_t* dst1 = b.Filled<uint8_t>(first.size(), 0);
  uint8_t* dst2 = b.Filled<uint8_t>(second.size(), 0);
  const auto timeout = std::chrono::milliseconds(5000);
  // The uploads land before another thread reads them (each thread's work is its own stream's).
  ASSERT_TRUE(backend_->Synchronize().ok());
  ASSERT_TRUE((*peer)->Synchronize().ok());
  // The sender on its own thread, as a prefill node's stream is; the socket's buffers take a
  // small message before its receive is posted, as NCCL's do.
  std::thread sender([&] {
    EXPECT_TRUE((*open)->Send(src1, first.size(), timeout).ok());
    EXPECT_TRUE((*open)->Send(src2, second.size(), timeout).ok());
    EXPECT_TRUE((*open)->Send(src2, second.size(), timeout).ok());
  });
  ASSERT_TRUE((*join)->Recv(dst1, first.size(), timeout).ok());
  ASSERT_TRUE((*join)->Recv(dst2, second.size(), timeout).ok());
  sender.join();
  EXPECT_EQ(b.DownloadBytes(dst1, first.size()), first);
  EXPECT_EQ(b.DownloadBytes(dst2, second.size()), second);
  // The third message is 37 bytes; a receive of 36 is out of step, and fails the link.
  EXPECT_EQ((*join)->Recv(dst2, 36, timeout).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ((*join)->Recv(dst2, 37, timeout).code(), absl::StatusCode::kCancelled);
  // The peer's end went with it: a send fails (at once, or when its bytes find no reader).
  join->reset();
  absl::Status sent;
  for (int i = 0; i < 50 && sent.ok(); ++i) {
    sent = (*open)->Send(src1, first.size(), std::chrono::milliseconds(200));
  }
  EXPECT_FALSE(sent.ok());
  // A receive nobody sends to: DEADLINE_EXCEEDED after its timeout, and the link aborted.
  std::string offer2;
  auto lonely = backend_->OpenLink(&offer2);
  ASSERT_TRUE(lonely.ok());
  auto other = (*peer)->JoinLink(offer2);
  ASSERT_TRUE(other.ok());
  std::thread receiver([&] {
    EXPECT_EQ((*other)->Recv(dst2, 37, std::chrono::milliseconds(300)).code(),
              absl::StatusCode::kDeadlineExceeded);
  });
  receiver.join();
  EXPECT_EQ((*other)->Recv(dst2, 37, timeout).code(), absl::StatusCode::kCancelled);
  // An end aborted from another thread fails its pending receive at once, not at its timeout.
  std::string offer3;
  auto third = backend_->OpenLink(&offer3);
  ASSERT_TRUE(third.ok());
  auto fourth = (*peer)->JoinLink(offer3);
  ASSERT_TRUE(fourth.ok());
  const auto t0 = std::chrono::steady_clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    (*third)->Abort();
  });
  EXPECT_FALSE((*third)->Recv(dst1, 10, std::chrono::milliseconds(20000)).ok());
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  // Memory that is not the backend's.
  std::vector<uint8_t> host(8);
  EXPECT_FALSE((*fourth)->Send(host.data(), host.size(), timeout).ok());
}

}  // namespace
}  // namespace kvwire::kernels
