// The decode node's parts on their own: the KV pool's accounting and byte sizes, and stop
// strings over streamed text.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>

#include "common/engine/stop_matcher.h"
#include "common/model/kv_pool.h"
#include "kernels/backend.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

TEST(KvPool, ReservesWholePagesAndGivesThemBack) {
  std::atomic<int> released{0};
  KvPool pool(10000, 1000, [&] { ++released; });
  auto a = pool.Allocate(1500);  // two pages
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool.used(), 2000u);
  auto b = pool.Allocate(8000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(pool.used(), 10000u);
  auto c = pool.Allocate(1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(c.status().message()).find("KV pool full"), std::string::npos);
  auto never = pool.Allocate(20000);
  EXPECT_NE(std::string(never.status().message()).find("pool holds 10000"), std::string::npos);
  EXPECT_FALSE(pool.CanEverFit(10001));
  a->reset();
  EXPECT_EQ(pool.used(), 8000u);
  EXPECT_EQ(released.load(), 1);
  // Writable memory of the asked size.
  std::memset((*b)->data(), 7, 8000);
  EXPECT_EQ((*b)->size(), 8000u);
  b->reset();
  EXPECT_EQ(pool.used(), 0u);
}

TEST(KvPool, LargeCachesAskForHugePagesSmallOnesDoNot) {
  KVWIRE_REQUIRE_VMFLAGS();
  KvPool pool(size_t{64} << 20, 4096);
  auto large = pool.Allocate(size_t{9} << 20);
  ASSERT_TRUE(large.ok()) << large.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*large)->data()) % kHugePageBytes, 0u);
  const std::string flags = testing::VmFlagsOf((*large)->data());
  ASSERT_FALSE(flags.empty()) << "no mapping in /proc/self/smaps holds the cache";
  EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;  // MADV_HUGEPAGE
  std::memset((*large)->data(), 1, size_t{9} << 20);
  // Small caches come from the heap as they are: 64-byte aligned, no advice asked.
  auto small = pool.Allocate(1000);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*small)->data()) % 64, 0u);
  EXPECT_EQ(testing::VmFlagsOf((*small)->data()).find(" hg"), std::string::npos);
}

// On a device backend (guarded here) the pool is one slab made up front: KV pages anywhere in it
// for caches, runs of consecutive pages for other state, all counted, all given back.
TEST(KvPool, OnABackendHandsOutPagesAndRunsOfOneSlab) {
  auto backend = kernels::MakeBackend(kernels::BackendKind::kGuarded, 1);
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::shared_ptr<kernels::KernelBackend> b = std::move(*backend);
  std::atomic<int> released{0};
  auto made = KvPool::OnBackend(b, 16 * 4096 + 100, 4096, [&] { ++released; });
  ASSERT_TRUE(made.ok()) << made.status();
  KvPool& pool = **made;
  EXPECT_TRUE(pool.paged());
  EXPECT_EQ(pool.capacity(), 16u * 4096);  // whole pages
  auto pages = pool.AllocatePages(10);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(pool.used(), 10u * 4096);
  EXPECT_EQ(pool.AllocatePages(7).status().code(), absl::StatusCode::kResourceExhausted);
  auto run = pool.Allocate(3 * 4096 - 5);  // three consecutive pages
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ((*run)->backend(), b.get());
  EXPECT_EQ(((*run)->data() - pool.slab()) % 4096, 0);
  EXPECT_EQ(pool.used(), 13u * 4096);
  pages->reset();
  EXPECT_EQ(pool.used(), 3u * 4096);
  EXPECT_EQ(released.load(), 1);
  // A cache in pages: its rows written through the backend read back through its layout.
  KvCacheShape shape{2, 16, DType::kF32, {37, 9}};
  auto cache = KvCache::CreatePaged(shape, pool);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_FALSE((*cache)->host_rows());
  const LayerCache& lc = (*cache)->layer(0);
  EXPECT_TRUE(lc.paged());
  EXPECT_EQ(lc.layout.page_tokens, 4096 / (2 * 2 * 16 * 4));  // 16 tokens of K and V a page
  std::vector<float> k(5 * 16), v(5 * 16);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i);
    v[i] = -static_cast<float>(i);
  }
  // Rows 14..18 of head 1 straddle a page boundary.
  ASSERT_TRUE((*cache)
                  ->WriteRows(0, 1, 14, 5, reinterpret_cast<const uint8_t*>(k.data()),
                              reinterpret_cast<const uint8_t*>(v.data()))
                  .ok());
  std::vector<float> row(16);
  ASSERT_TRUE(b->CopyToHost(row.data(), lc.k_row(1, 16), 16 * sizeof(float)).ok());
  EXPECT_EQ(row[0], 32.f);  // row 16 is the third written
  ASSERT_TRUE(b->CopyToHost(row.data(), lc.v_row(1, 18), 16 * sizeof(float)).ok());
  EXPECT_EQ(row[15], -79.f);
  EXPECT_EQ((*cache)->WriteRows(0, 1, 35, 5, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // past the capacity
  cache->reset();
  run->reset();
  EXPECT_EQ(pool.used(), 0u);
  // A page too small for one token of K and V is refused, saying so.
  KvCacheShape wide{8, 128, DType::kF32, {4}};
  auto refused = KvCache::CreatePaged(wide, pool);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("holds no token"), std::string::npos);
}

TEST(KvPool, ParseBytes) {
  EXPECT_EQ(*ParseBytes("1GiB"), size_t{1} << 30);
  EXPECT_EQ(*ParseBytes("512MiB"), size_t{512} << 20);
  EXPECT_EQ(*ParseBytes("64KiB"), size_t{64} << 10);
  EXPECT_EQ(*ParseBytes("2g"), size_t{2} << 30);
  EXPECT_EQ(*ParseBytes(" 1000 "), 1000u);
  EXPECT_EQ(*ParseBytes("1.5KiB"), 1536u);
  for (const char* bad : {"", "lots", "-1GiB", "1XB"}) {
    auto r = ParseBytes(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(StopMatcher, HoldsBackPossiblePrefixesAndStopsBeforeTheString) {
  StopMatcher m({"END", "\n\n"});
  EXPECT_EQ(m.Push("hello E"), "hello ");  // "E" may start "END"
  EXPECT_EQ(m.Push("x"), "Ex");
  EXPECT_EQ(m.Push(" and\n"), " and");
  EXPECT_EQ(m.Push("more"), "\nmore");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.Push(" stuff EN"), " stuff ");
  EXPECT_EQ(m.Push("D after"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.Push("ignored"), "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopMatcher, FlushReleasesTheHeldTail) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.Push("almost ST"), "almost ");
  EXPECT_EQ(m.Flush(), "ST");
  StopMatcher none({});
  EXPECT_EQ(none.Push("anything"), "anything");
}

TEST(StopMatcher, StopStringInsideOneDelta) {
  StopMatcher m({"cat"});
  EXPECT_EQ(m.Push("the cat sat"), "the ");
  EXPECT_TRUE(m.stopped());
}

}  // namespace
}  // namespace kvwire
