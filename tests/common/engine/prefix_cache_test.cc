// The prefix cache on its own (common/engine/prefix_cache.h): chained keys (a block hits only
// after every block before it), a prompt that shares part of a block, the reuse bound, what a
// prefill fills becoming visible only when it ran whole, eviction least recently used within
// the byte bound and never under a reader, and two models' caches apart.
#include "common/engine/prefix_cache.h"

#include <gtest/gtest.h>

#include <numeric>

namespace kvwire {
namespace {

constexpr int kLayers = 2, kKvDim = 4, kBlock = 8;

class PrefixCacheTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = *kernels::MakeBackend(kernels::BackendKind::kCpu, 1); }
  std::unique_ptr<PrefixCache> Cache(int blocks, const std::string& model = "m") {
    return std::make_unique<PrefixCache>(backend_, kLayers, kKvDim, kBlock,
                                         blocks * PrefixCache::BlockBytes(kLayers, kKvDim, kBlock),
                                         model);
  }
  static std::vector<int32_t> Prompt(int len, int32_t from = 100) {
    std::vector<int32_t> ids(len);
    std::iota(ids.begin(), ids.end(), from);
    return ids;
  }
  // A prefill's layers as the model lays them out: token t's K then V at row t (stride 3·kv,
  // as the model's q|k|v rows), valued by layer, token and element.
  static std::vector<float> Rows(int layer, int len) {
    std::vector<float> rows(static_cast<size_t>(len) * 3 * kKvDim);
    for (int t = 0; t < len; ++t) {
      for (int x = 0; x < 2 * kKvDim; ++x) rows[t * 3 * kKvDim + x] = layer * 1000 + t + 0.01f * x;
    }
    return rows;
  }
  // Fills and finishes `plan` as a prefill of `len` tokens would.
  static void Run(PrefixCache& cache, PrefixCache::Plan& plan, int len, bool whole = true) {
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<float> rows = Rows(l, len);
      ASSERT_TRUE(cache.Capture(plan, l, rows.data(), rows.data() + kKvDim, 3 * kKvDim).ok());
    }
    cache.Finish(plan, whole);
  }
  std::shared_ptr<kernels::KernelBackend> backend_;
};

TEST_F(PrefixCacheTest, APromptReadsTheBlocksAnEarlierOneFilled) {
  auto cache = Cache(16);
  const std::vector<int32_t> a = Prompt(30);  // 3 whole blocks, 6 tokens over
  PrefixCache::Plan cold = cache->Lookup(a, 29);
  EXPECT_EQ(cold.hit_tokens(), 0);
  EXPECT_EQ(cold.fill_from, 0);
  EXPECT_EQ(cold.fill.size(), 3u);
  Run(*cache, cold, 30);
  EXPECT_EQ(cache->counters().blocks, 3);
  // The same prompt: every whole block, as the model computed its rows.
  PrefixCache::Plan warm = cache->Lookup(a, 29);
  ASSERT_EQ(warm.hit_tokens(), 24);
  EXPECT_TRUE(warm.fill.empty());
  for (int b = 0; b < 3; ++b) {
    for (int l = 0; l < kLayers; ++l) {
      const float* block = warm.prefix.blocks[b][l];
      for (int t = 0; t < kBlock; ++t) {
        for (int x = 0; x < 2 * kKvDim; ++x) {
          ASSERT_EQ(block[t * 2 * kKvDim + x], l * 1000 + (b * kBlock + t) + 0.01f * x);
        }
      }
    }
  }
  cache->Finish(warm, true);
  // Bounded by the reuse limit (the window's tokens are computed anew): two blocks.
  PrefixCache::Plan bounded = cache->Lookup(a, 23);
  EXPECT_EQ(bounded.hit_tokens(), 16);
  EXPECT_TRUE(bounded.fill.empty());  // the next block is cached already
  cache->Finish(bounded, true);
  // Sharing 13 tokens, one block and part of the next: one block, then its own blocks.
  std::vector<int32_t> b = a;
  b[13] = 7;
  PrefixCache::Plan part = cache->Lookup(b, 29);
  EXPECT_EQ(part.hit_tokens(), 8);
  EXPECT_EQ(part.fill_from, 8);
  EXPECT_EQ(part.fill.size(), 2u);
  Run(*cache, part, 30);
  // A later block alone never hits: the keys chain, so a changed first token misses all.
  std::vector<int32_t> c = a;
  c[0] = 1;
  PrefixCache::Plan other = cache->Lookup(c, 29);
  EXPECT_EQ(other.hit_tokens(), 0);
  cache->Finish(other, false);
  // Another model's cache with the same prompts: its own keys.
  auto second = Cache(16, "another");
  PrefixCache::Plan apart = second->Lookup(a, 29);
  EXPECT_EQ(apart.hit_tokens(), 0);
  second->Finish(apart, false);
}

TEST_F(PrefixCacheTest, WhatAFailedPrefillFilledIsDropped) {
  auto cache = Cache(4);
  PrefixCache::Plan failed = cache->Lookup(Prompt(24), 23);
  EXPECT_EQ(failed.fill.size(), 3u);
  EXPECT_EQ(cache->counters().blocks, 3);  // reserved while it fills
  Run(*cache, failed, 24, /*whole=*/false);
  EXPECT_EQ(cache->counters().blocks, 0);
  EXPECT_EQ(cache->counters().bytes, 0);
  PrefixCache::Plan again = cache->Lookup(Prompt(24), 23);
  EXPECT_EQ(again.hit_tokens(), 0);
  cache->Finish(again, false);
}

TEST_F(PrefixCacheTest, EvictsTheLeastRecentlyUsedButNeverUnderAReader) {
  auto cache = Cache(4);
  PrefixCache::Plan a = cache->Lookup(Prompt(16, 0), 15);  // 2 blocks
  Run(*cache, a, 16);
  PrefixCache::Plan b = cache->Lookup(Prompt(16, 500), 15);  // 2 more: full
  Run(*cache, b, 16);
  EXPECT_EQ(cache->counters().blocks, 4);
  // A's first block is read again (and held); B's are now the most recent of the rest, so a
  // new prompt of 2 blocks evicts A's second, which was used longest ago, then B's second
  // (a chain is evicted from its end), and never the block being read.
  PrefixCache::Plan reader = cache->Lookup(Prompt(16, 0), 8);
  ASSERT_EQ(reader.hit_tokens(), 8);
  PrefixCache::Plan c = cache->Lookup(Prompt(16, 900), 15);
  EXPECT_EQ(c.fill.size(), 2u);
  EXPECT_EQ(cache->counters().evictions, 2);
  Run(*cache, c, 16);
  for (int32_t from : {0, 500, 900}) {
    EXPECT_EQ(cache->CachedTokens(Prompt(16, from)), from == 900 ? 16 : 8) << from;
  }
  // Every block held by a reader: a new prompt fills nothing and evicts nothing.
  std::vector<PrefixCache::Plan> readers;
  for (int32_t from : {500, 900}) readers.push_back(cache->Lookup(Prompt(16, from), 16));
  const int64_t evictions = cache->counters().evictions;
  PrefixCache::Plan d = cache->Lookup(Prompt(40, 2000), 39);
  EXPECT_TRUE(d.fill.empty());
  EXPECT_EQ(cache->counters().evictions, evictions);
  EXPECT_EQ(static_cast<size_t>(cache->counters().bytes),
            4 * PrefixCache::BlockBytes(kLayers, kKvDim, kBlock));
  cache->Finish(d, false);
  for (auto& r : readers) cache->Finish(r, true);
  cache->Finish(reader, true);
}

}  // namespace
}  // namespace kvwire
