// The sparse selection's kernels, kernels/cuda/summaries.cuh (page min/max summaries) and
// kernels/cuda/page_scores.cuh (hybrid, Quest and exact scores), run where no GPU is, on
// emulated blocks under several scheduling orders, against the reference: caches in each dtype
// and coded (fp8, int8, int4, their residuals in the dtype), in regions and in pages; summaries
// built over the prompt and then over appended tokens; query-head groups of 1 to 8; pages of
// 1 to 32 tokens, tiled and not. The summaries must be the reference's bytes.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/kv_format.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "emulated_block.h"
#include "kernels/backend.h"
#include "kernels/cuda/page_scores.cuh"  // over the stand-in cuda_util.cuh
#include "kernels/cuda/summaries.cuh"
#include "tests/common/model/random_cache.h"
#include "tests/kernels/ops_test_util.h"

namespace kvwire {
namespace {

namespace ps = kernels::cuda::page_scoring;
namespace su = kernels::cuda::summary_update;
using kernels::PageScoreKind;
using kernels::PageScoreSegment;
using kernels::SummaryLayout;
using kernels::SummaryUpdateSegment;

absl::Status EmulateSummaries(const kernels::UpdateSummariesParams& p, emulated::Order order) {
  const std::vector<su::HeadItem> items = su::ItemsFor(p);
  if (items.empty()) return absl::OkStatus();
  return kernels::cuda::DispatchDType(items.front().s.layout.dtype, [&]<typename T>() {
    return emulated::RunGrid({static_cast<unsigned>(items.size()), 1, 1}, su::kThreads, order,
                             [&] { su::UpdateSummariesKernel<T>(items.data()); })
               ? absl::OkStatus()
               : absl::InternalError("the block's threads deadlocked");
  });
}

absl::Status EmulatePageScores(const kernels::PageScoresParams& p, emulated::Order order) {
  const ps::Plan plan = ps::PlanFor(p);
  std::vector<float> work(std::max<int64_t>(plan.work, 1), std::nanf(""));
  return kernels::cuda::DispatchDType(p.dtype, [&]<typename T>() {
    return emulated::RunGrid(
               {static_cast<unsigned>(p.count), 1, 1}, ps::kThreads, order,
               [&] { ps::PageScoresKernel<T>(plan.segs.data(), p.head_dim, work.data()); },
               plan.shared)
               ? absl::OkStatus()
               : absl::InternalError("the block's threads deadlocked");
  });
}

struct Case {
  KvFormat format;  // kAuto: the cache in the dtype
  DType dtype;
  int d, group, kept, appended;
  int page, tile_pages;
  size_t page_bytes;  // of the cache's pool; 0: a host region
};

TEST(SelectionEmulated, SummariesAndPageScoresEqualTheReference) {
  constexpr KvFormat kAuto = KvFormat::kAuto, kF8 = KvFormat::kFP8, kI8 = KvFormat::kInt8,
                     kI4 = KvFormat::kInt4;
  const Case cases[] = {
      {kAuto, DType::kBF16, 64, 4, 300, 37, 16, 1 << 30, 4 << 10},
      {kAuto, DType::kF32, 128, 1, 513, 0, 1, 1 << 30, 0},
      {kAuto, DType::kF16, 32, 8, 90, 5, 32, 2, 0},
      {kF8, DType::kBF16, 64, 2, 290, 140, 16, 4, 8 << 10},
      {kI8, DType::kF32, 128, 4, 145, 3, 8, 1 << 30, 0},
      {kI4, DType::kBF16, 64, 4, 272, 130, 16, 1 << 30, 4 << 10},
      {kI4, DType::kF16, 128, 1, 40, 200, 4, 3, 0},
  };
  constexpr int kHeads = 2;
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  ASSERT_TRUE(reference.ok());
  int run = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(KvFormatName(c.format), " ", DTypeName(c.dtype), " d=", c.d,
                              " group=", c.group, " kept=", c.kept, " appended=", c.appended,
                              " page=", c.page, c.page_bytes ? " paged" : " region"));
    std::unique_ptr<KvPool> pool;
    if (c.page_bytes > 0) {
      auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 1);
      ASSERT_TRUE(cpu.ok());
      auto made = KvPool::OnBackend(std::move(*cpu), size_t{64} << 20, c.page_bytes);
      ASSERT_TRUE(made.ok()) << made.status();
      pool = std::move(*made);
    }
    std::mt19937 rng(static_cast<uint32_t>(c.d * 3 + c.kept));
    std::unique_ptr<KvCache> cache = RandomCache(c.format, c.dtype, c.d, kHeads, c.kept, c.appended,
                                                 rng(), pool.get(), /*size_every=*/97);
    ASSERT_NE(cache, nullptr);
    LayerCache& lc = cache->layer(0);
    const int capacity = c.kept + c.appended;
    const SummaryLayout l{c.d, c.page, c.tile_pages, (capacity + c.page - 1) / c.page, c.dtype};
    const size_t bytes = kHeads * l.head_elems() * DTypeSize(c.dtype);
    // [0]: the reference's summaries, [1]: the emulated kernel's; the prompt's, then the pages
    // of each appended run.
    std::vector<uint8_t> sums[2] = {std::vector<uint8_t>(bytes, 0), std::vector<uint8_t>(bytes, 0)};
    auto update = [&](int first) {
      for (int side = 0; side < 2; ++side) {
        const SummaryUpdateSegment s{lc.k,  lc.layout, lc.coding,         kHeads,
                                     first, lc.len,    sums[side].data(), l};
        const emulated::Order order = emulated::kOrders[run++ % std::size(emulated::kOrders)];
        const absl::Status st =
            side == 0 ? (*reference)->UpdateSummaries({&s, 1}) : EmulateSummaries({&s, 1}, order);
        ASSERT_TRUE(st.ok()) << st;
      }
      EXPECT_TRUE(SameBytes(sums[1], sums[0]));
    };
    ASSERT_NO_FATAL_FAILURE(update(0));
    int appended = 0;
    for (int step : {1, 7, c.appended}) {  // runs of 1, 6 and the rest
      const int first = lc.len;
      for (; appended < std::min(step, c.appended); ++appended) {
        const std::vector<float> k = RandomRows(kHeads, c.d, rng),
                                 v = RandomRows(kHeads, c.d, rng, 0.5f);
        kernels::KvAppend a{k.data(), v.data(), lc.k, lc.v, lc.layout, lc.coding, lc.len};
        ASSERT_TRUE((*reference)->AppendKv({&a, 1, kHeads, kHeads, c.d, c.dtype}).ok());
        ++lc.len;
      }
      if (lc.len > first) {
        ASSERT_NO_FATAL_FAILURE(update(first));
      }
    }
    // Every kind of score for each head, its queries a group of c.group.
    const std::vector<float> q = RandomRows(kHeads * c.group, c.d, rng, 0.5f);
    for (PageScoreKind kind :
         {PageScoreKind::kHybrid, PageScoreKind::kQuest, PageScoreKind::kExact}) {
      SCOPED_TRACE(absl::StrCat("kind ", static_cast<int>(kind)));
      const int n = kind == PageScoreKind::kExact ? lc.len : l.pages(lc.len);
      std::vector<float> scores[2] = {std::vector<float>(kHeads * n, std::nanf("")),
                                      std::vector<float>(kHeads * n, std::nanf(""))};
      for (int side = 0; side < 2; ++side) {
        std::vector<PageScoreSegment> segs(kHeads);
        for (int h = 0; h < kHeads; ++h) {
          PageScoreSegment& s = segs[h];
          s.kind = kind;
          s.q = q.data() + int64_t{h} * c.group * c.d;
          s.group = c.group;
          s.len = lc.len;
          s.summaries = sums[side].data() + h * l.head_elems() * DTypeSize(c.dtype);
          s.layout = l;
          s.top_r = h == 0 ? c.d : 1 + 7 * h;
          s.k = lc.k;
          s.kv = lc.layout;
          s.coding = lc.coding;
          s.head = h;
          s.scale = 1.f / std::sqrt(static_cast<float>(c.d));
          s.score = scores[side].data() + int64_t{h} * n;
        }
        const kernels::PageScoresParams p{segs.data(), kHeads, c.d, c.dtype};
        const emulated::Order order = emulated::kOrders[run++ % std::size(emulated::kOrders)];
        const absl::Status st =
            side == 0 ? (*reference)->PageScores(p) : EmulatePageScores(p, order);
        ASSERT_TRUE(st.ok()) << st;
      }
      // As BackendOpsTest.PageScores: the reductions over pages are trees here.
      EXPECT_TRUE(kernels::AllClose(scores[1], scores[0], {1e-6f, 2e-4f}));
    }
  }
}

}  // namespace
}  // namespace kvwire
