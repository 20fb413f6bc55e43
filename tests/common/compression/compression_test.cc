// Compression policies: small hand-computed cases for each, invariants over random
// inputs for all, parameter validation, and the policies inside real generation.
#include "common/compression/compression.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "common/engine/generate.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

using Kept = std::vector<std::vector<int32_t>>;

// Window scores whose votes (sums over window rows) equal `votes[h][j]` on the prefix:
// the whole vote goes into the first window row. Window columns get 1.0 so that a
// policy that wrongly voted on them would show it.
struct Scores {
  std::vector<float> data;
  WindowScores view;
  Scores(const std::vector<std::vector<float>>& votes, int window, int len) {
    const int heads = static_cast<int>(votes.size());
    data.assign(static_cast<size_t>(heads) * window * len, 0.f);
    for (int h = 0; h < heads; ++h) {
      for (int j = 0; j < len; ++j) {
        data[(static_cast<size_t>(h) * window) * len + j] =
            j < static_cast<int>(votes[h].size()) ? votes[h][j] : 1.f;
      }
    }
    view = {data.data(), heads, window, len};
  }
};

Kept Select(const CompressionConfig& c, int n_heads, int n_kv, const Scores& s, int layer = 0) {
  LayerSelector sel(c, n_heads, n_kv);
  auto r = sel.Select(layer, s.view.len, &s.view);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : Kept{};
}

// A policy by name with parameters by name, as flags and requests give them.
PolicyPtr Make(const std::string& name, const ParamValues& params = {}) {
  auto p = MakePolicy(name, params);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : FullPolicy();
}

CompressionConfig Config(const std::string& policy, int budget, int window,
                         const ParamValues& params = {}) {
  CompressionConfig c;
  c.policy = Make(policy, params);
  c.budget = budget;
  c.window = window;
  return c;
}

// ------------------------------------------------------------------ hand-computed cases

TEST(SnapKV, TopVotesPlusWindowWithoutPooling) {
  // L = 10, w = 2 → prefix 0..7; budget 5 → 3 prefix positions.
  CompressionConfig c = Config("snapkv", 5, 2, {{"kernel", "1"}});
  Scores s({{0.1f, 0.9f, 0.2f, 0.8f, 0.0f, 0.3f, 0.7f, 0.05f}}, 2, 10);
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{1, 3, 6, 8, 9}}));
}

TEST(SnapKV, MaxPoolingSpreadsPeaksAndTiesKeepThePeak) {
  // Kernel 3 max-pool of [0,0,5,0,0,0,0,4] = [0,5,5,5,0,0,4,4]; the top 3 are the plateau
  // 1, 2, 3.
  CompressionConfig c = Config("snapkv", 5, 2, {{"kernel", "3"}});
  Scores s({{0, 0, 5, 0, 0, 0, 0, 4}}, 2, 10);
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{1, 2, 3, 8, 9}}));
  // The 4th cuts through the plateau 6, 7: the raw vote breaks the tie, so the peak (7) is
  // kept, not merely the plateau's leftmost position (docs/algorithms.md §0).
  c.budget = 6;
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{1, 2, 3, 7, 8, 9}}));
  // Among equal raw votes too, the lower position: [0,0,5,0,0,0,4,4] pools to
  // [0,5,5,5,0,4,4,4]; the 4th slot goes to 6 (raw 4, the lower of the two peaks).
  Scores t({{0, 0, 5, 0, 0, 0, 4, 4}}, 2, 10);
  EXPECT_EQ(Select(c, 1, 1, t), (Kept{{1, 2, 3, 6, 8, 9}}));
}

TEST(SnapKV, AKernelWiderThanThePrefixStillFindsThePeak) {
  // Every pooled score equals the maximum; the raw votes decide. Without the tie-break the
  // policy would keep the first budget - window positions.
  CompressionConfig c = Config("snapkv", 4, 2, {{"kernel", "63"}});
  Scores s({{0.1f, 0, 0, 0, 0.2f, 0, 0.9f, 0}}, 2, 10);
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{4, 6, 8, 9}}));
  c.policy = Make("snapkv_pp", {{"kernel_small", "511"}});
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{4, 6, 8, 9}}));
}

// A NaN score (a corrupt model) ranks below every number rather than breaking the sort.
TEST(SnapKV, NaNVotesRankLast) {
  CompressionConfig c = Config("snapkv", 4, 2, {{"kernel", "1"}});
  Scores s({{NAN, 0.3f, NAN, 0.1f, 0.2f, NAN}}, 2, 8);
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{1, 4, 6, 7}}));
}

TEST(SnapKV, AvgPoolingCountsThePadding) {
  // avg_pool1d(kernel 3, pad 1) divides by 3 even at the edge: [3, 0, 0, 1.5, 0, 0]
  // pools to [1, 1, 0.5, 0.5, 0.5, 0] (dividing by the 2 real neighbours would give 1.5
  // at position 0).
  CompressionConfig c = Config("snapkv", 4, 2, {{"kernel", "3"}, {"pool", "avg"}});
  Scores s({{3, 0, 0, 1.5f, 0, 0}}, 2, 8);
  // pooled = [1, 1, 0.5, 0.5, 0.5, 0] → top 2 = 0, 1
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{0, 1, 6, 7}}));
}

TEST(SnapKV, GqaModes) {
  // Two query heads share one KV head. Head 0 votes for 1, head 1 for 5 (more strongly).
  const std::vector<std::vector<float>> votes = {{0, 0.6f, 0, 0, 0, 0.1f},
                                                 {0, 0.1f, 0, 0, 0, 0.8f}};
  Scores s(votes, 2, 8);
  // One prefix slot.
  CompressionConfig c = Config("snapkv", 3, 2, {{"kernel", "1"}, {"gqa", "per_query_head"}});
  EXPECT_EQ(Select(c, 2, 1, s), (Kept{{1, 6, 7}, {5, 6, 7}}));
  EXPECT_EQ(c.CacheHeads(2, 1), 2);
  c.policy = Make("snapkv", {{"kernel", "1"}, {"gqa", "sum"}});  // 0.7 vs 0.9
  EXPECT_EQ(Select(c, 2, 1, s), (Kept{{5, 6, 7}}));
  c.policy = Make("snapkv", {{"kernel", "1"}, {"gqa", "mean"}});
  EXPECT_EQ(Select(c, 2, 1, s), (Kept{{5, 6, 7}}));
  c.policy = Make("snapkv", {{"kernel", "1"}, {"gqa", "max"}});  // 0.6 vs 0.8
  EXPECT_EQ(Select(c, 2, 1, s), (Kept{{5, 6, 7}}));
  // Max differs from sum when one head is strong and the other spread: 0.7 at 1 from a
  // single head beats 0.4 + 0.4 at 3.
  Scores t({{0, 0.7f, 0, 0.4f, 0, 0}, {0, 0, 0, 0.4f, 0, 0}}, 2, 8);
  EXPECT_EQ(Select(c, 2, 1, t), (Kept{{1, 6, 7}}));
  c.policy = Make("snapkv", {{"kernel", "1"}, {"gqa", "sum"}});
  EXPECT_EQ(Select(c, 2, 1, t), (Kept{{3, 6, 7}}));
}

TEST(SnapKVpp, GroupSumAndKernelByPromptLength) {
  // Group sum then max-pool. Votes peak at 2 (head 0) and 6 (head 1, stronger).
  const std::vector<std::vector<float>> votes = {{0, 0, 0.5f, 0, 0, 0, 0, 0},
                                                 {0, 0, 0, 0, 0, 0, 0.9f, 0}};
  Scores s(votes, 2, 10);
  // L = 10 < 100: kernel_small.
  CompressionConfig c =
      Config("snapkv_pp", 3, 2,
             {{"kernel_small", "1"}, {"kernel_large", "5"}, {"kernel_threshold", "100"}});
  EXPECT_EQ(Select(c, 2, 1, s), (Kept{{6, 8, 9}}));
  c.budget = 5;  // .9 at 6, .5 at 2, then a tie of zeros goes to position 0
  EXPECT_EQ(Select(c, 2, 1, s), (Kept{{0, 2, 6, 8, 9}}));
  // L ≥ threshold: kernel 5 spreads 0.9 over 4..7 (clipped at the prefix end): top 3 = 4, 5, 6.
  c.policy =
      Make("snapkv_pp", {{"kernel_small", "1"}, {"kernel_large", "5"}, {"kernel_threshold", "10"}});
  EXPECT_EQ(Select(c, 2, 1, s), (Kept{{4, 5, 6, 8, 9}}));
}

TEST(ChunkKV, WholeChunksByMeanScoreCutToBudget) {
  // Prefix 0..8 in chunks of 3: [0-2] mean 0.1, [3-5] mean 0.5, [6-8] mean 0.3.
  // One index set for both KV heads, from votes summed over all query heads.
  const std::vector<std::vector<float>> votes = {
      {0.1f, 0.1f, 0.1f, 0.4f, 0.5f, 0.6f, 0.2f, 0.2f, 0.2f},
      {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.1f, 0.1f, 0.1f},
      {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f},
      {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}};
  Scores s(votes, 2, 11);
  CompressionConfig c = Config("chunkkv", 5, 2, {{"chunk", "3"}});  // 3 prefix tokens: one chunk
  EXPECT_EQ(Select(c, 4, 2, s), (Kept{{3, 4, 5, 9, 10}, {3, 4, 5, 9, 10}}));
  // 5 prefix tokens: chunk [3-5], then [6-8] cut to its first two → drops position 8.
  c.budget = 7;
  EXPECT_EQ(Select(c, 4, 2, s), (Kept{{3, 4, 5, 6, 7, 9, 10}, {3, 4, 5, 6, 7, 9, 10}}));
}

// chunk_scope=per_kv_head: each KV head takes its own chunks, from its group's votes.
TEST(ChunkKV, PerKvHeadScopeChoosesPerGroup) {
  // Prefix 0..8 in chunks of 3. Heads 0-1 (KV head 0) favour [3-5]; heads 2-3 (KV head 1)
  // favour [6-8]; summed over all heads [3-5] would win for both.
  const std::vector<std::vector<float>> votes = {{0.f, 0.f, 0.f, 0.9f, 0.9f, 0.9f, 0.f, 0.f, 0.f},
                                                 {0.f, 0.f, 0.f, 0.9f, 0.9f, 0.9f, 0.f, 0.f, 0.f},
                                                 {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.5f, 0.5f, 0.5f},
                                                 {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.5f, 0.5f, 0.5f}};
  Scores s(votes, 2, 11);
  CompressionConfig c = Config("chunkkv", 5, 2, {{"chunk", "3"}, {"chunk_scope", "per_kv_head"}});
  EXPECT_EQ(Select(c, 4, 2, s), (Kept{{3, 4, 5, 9, 10}, {6, 7, 8, 9, 10}}));
  c = Config("chunkkv", 5, 2, {{"chunk", "3"}});
  EXPECT_EQ(Select(c, 4, 2, s), (Kept{{3, 4, 5, 9, 10}, {3, 4, 5, 9, 10}}));
  EXPECT_FALSE(MakePolicy("chunkkv", {{"chunk_scope", "per_head"}}).ok());
}

// The chunk cut to fit the budget is the lowest ranked of those taken, not the one nearest
// the window: the best chunk stays whole wherever it lies.
TEST(ChunkKV, TheLastChunkTakenIsTheOneCut) {
  // Prefix 0..8 in chunks of 3: [0-2] mean 0.3, [3-5] mean 0.1, [6-8] mean 0.5.
  const std::vector<std::vector<float>> votes = {
      {0.3f, 0.3f, 0.3f, 0.1f, 0.1f, 0.1f, 0.5f, 0.5f, 0.5f}};
  Scores s(votes, 2, 11);
  CompressionConfig c = Config("chunkkv", 7, 2, {{"chunk", "3"}});  // 5 prefix tokens
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{0, 1, 6, 7, 8, 9, 10}}));
}

TEST(ChunkKV, LayerReuseSharesTheFirstLayersIndices) {
  CompressionConfig c = Config("chunkkv", 5, 2, {{"chunk", "3"}, {"reuse_layers", "2"}});
  LayerSelector sel(c, 1, 1);
  Scores a({{0, 0, 0, 1, 1, 1, 0, 0, 0}}, 2, 11);
  Scores b({{1, 1, 1, 0, 0, 0, 0, 0, 0}}, 2, 11);
  auto l0 = sel.Select(0, 11, &a.view);
  ASSERT_TRUE(l0.ok());
  EXPECT_FALSE(sel.NeedsScoresFor(1, 11));
  auto l1 = sel.Select(1, 11, nullptr);  // reused: no scores needed
  ASSERT_TRUE(l1.ok());
  EXPECT_EQ(*l1, *l0);
  EXPECT_TRUE(sel.NeedsScoresFor(2, 11));
  auto l2 = sel.Select(2, 11, &b.view);
  ASSERT_TRUE(l2.ok());
  EXPECT_EQ(*l2, (Kept{{0, 1, 2, 9, 10}}));
  EXPECT_EQ(*sel.Select(3, 11, nullptr), *l2);
}

// The layers that reuse an anchor's selection get no window scores from the model: ChunkKV's
// saving is not computing them (Algorithm 2).
TEST(ChunkKV, ReusingLayersComputeNoWindowScores) {
  auto model = LlamaModel::Load("synthetic:stories");
  ASSERT_TRUE(model.ok());
  class Spy : public CompressedLayerSink {
   public:
    absl::Status Accept(CompressedLayer) override { return absl::OkStatus(); }
  } sink;
  class Recording : public PrefillObserver {
   public:
    explicit Recording(Compressor* c) : c_(c) {}
    int window(int len) const override { return c_->window(len); }
    bool NeedsScores(int layer, int len) const override { return c_->NeedsScores(layer, len); }
    absl::Status OnLayer(const PrefillLayer& l) override {
      scored.push_back(l.window_scores != nullptr);
      return c_->OnLayer(l);
    }
    absl::Status Finish() override { return c_->Finish(); }
    std::vector<bool> scored;

   private:
    Compressor* c_;
  };
  Compressor compressor(Config("chunkkv", 40, 8, {{"reuse_layers", "2"}}), (*model)->config(),
                        (*model)->kv_dtype(), &sink);
  Recording spy(&compressor);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 120; ++i) prompt.push_back(3 + (i * 7) % 400);
  ASSERT_TRUE((*model)->Prefill(prompt, &spy).ok());
  EXPECT_EQ(spy.scored, (std::vector<bool>{true, false, true, false, true}));  // 5 layers
}

TEST(HBW, BlockMeansAndHierarchicalGroups) {
  // Prefix 16 in blocks of 2 (8 blocks). Block means: b0 .9, b1 .8, b2 .7, b3 .3,
  // b4 .05, b5 .04, b6 .2, b7 .03. Prefix budget 8 = two rounds of 4 tokens.
  std::vector<float> tok = {.9f,  .9f,  .8f,  .8f,  .7f, .7f, .3f,  .3f,
                            .05f, .05f, .04f, .04f, .2f, .2f, .03f, .03f};
  Scores s({tok}, 2, 18);
  CompressionConfig c = Config("hbw", 10, 2, {{"block", "2"}, {"groups", "1,2"}});
  // Round M=1 (4 tokens): b0, b1. Round M=2 (2 tokens per half): first half b0..b3 →
  // best unselected b2; second half b4..b7 → b6.
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{0, 1, 2, 3, 4, 5, 12, 13, 16, 17}}));
  // M={1} alone (block-wise SnapKV) piles everything at the front: b0..b3.
  c.policy = Make("hbw", {{"block", "2"}, {"groups", "1"}});
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{0, 1, 2, 3, 4, 5, 6, 7, 16, 17}}));
  c.policy =
      Make("hbw", {{"block", "2"}, {"groups", "4"}});  // 2 tokens per quarter: b0 | b2 | b4 | b6
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{0, 1, 4, 5, 8, 9, 12, 13, 16, 17}}));
  // Odd capacity: 7 prefix tokens with blocks of 2 → 3 whole blocks then the first
  // token of the next best block (b3).
  c.policy = Make("hbw", {{"block", "2"}, {"groups", "1"}});
  c.budget = 9;
  EXPECT_EQ(Select(c, 1, 1, s), (Kept{{0, 1, 2, 3, 4, 5, 6, 16, 17}}));
}

// At a realistic budget the M = 8 round keeps as many whole blocks as the M = 1 round, spread
// over the prompt (docs/algorithms.md §6.2): budget 512, window 32, block 512/32 = 16, a
// 992-token prefix of 62 blocks, votes falling with position. The 30 whole blocks of the
// 480-token prefix budget: round M=1 takes the best 15 (blocks 0-14); round M=8 gives groups
// [0,7) [7,15) [15,23) [23,31) [31,38) [38,46) [46,54) [54,62) quotas 2,2,2,2,2,2,2,1: the
// first two have nothing left, the others take their best two (one); the 4 blocks left go
// to the best remaining (17-20).
TEST(HBW, SecondRoundKeepsHalfTheBlocksSpreadOverThePrompt) {
  std::vector<float> votes(992);
  for (int j = 0; j < 992; ++j) votes[j] = 1000.f - j;
  Scores s({votes}, 32, 1024);
  const Kept kept = Select(Config("hbw", 512, 32), 1, 1, s);
  ASSERT_EQ(kept.size(), 1u);
  std::set<int> blocks;
  for (int32_t j : kept[0]) {
    if (j < 992) blocks.insert(j / 16);
  }
  std::set<int> want;
  for (int b = 0; b <= 20; ++b) want.insert(b);
  for (int b : {23, 24, 31, 32, 38, 39, 46, 47, 54}) want.insert(b);
  EXPECT_EQ(blocks, want);
  EXPECT_EQ(kept[0].size(), 512u);
}

TEST(Streaming, SinksPlusRecent) {
  CompressionConfig c = Config("streaming", 6, 2, {{"sinks", "2"}});
  LayerSelector sel(c, 2, 2);
  EXPECT_EQ(*sel.Select(0, 10, nullptr), (Kept{{0, 1, 6, 7, 8, 9}, {0, 1, 6, 7, 8, 9}}));
}

TEST(Random, SeededDistinctAndDifferentPerHeadAndLayer) {
  CompressionConfig c = Config("random", 20, 4, {{"seed", "9"}});
  LayerSelector a(c, 4, 2), b(c, 4, 2);
  const auto ka = *a.Select(0, 100, nullptr);
  EXPECT_EQ(ka, *b.Select(0, 100, nullptr));  // deterministic
  EXPECT_NE(ka[0], ka[1]);                    // heads differ
  EXPECT_NE(ka, *a.Select(1, 100, nullptr));  // layers differ
  c.policy = Make("random", {{"seed", "10"}});
  LayerSelector d(c, 4, 2);
  EXPECT_NE(ka, *d.Select(0, 100, nullptr));
}

// ------------------------------------------------------------------ invariants

std::vector<float> RandomSoftmaxScores(int heads, int window, int len, std::mt19937& rng) {
  std::vector<float> s(static_cast<size_t>(heads) * window * len, 0.f);
  std::exponential_distribution<float> e(1.f);
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < window; ++i) {
      const int q = len - window + i;
      float* row = s.data() + (static_cast<size_t>(h) * window + i) * len;
      float z = 0;
      for (int j = 0; j <= q; ++j) z += row[j] = std::pow(e(rng), 3.f);
      for (int j = 0; j <= q; ++j) row[j] /= z;
    }
  }
  return s;
}

TEST(CompressionInvariants, BudgetWindowSortedUnique) {
  std::mt19937 rng(17);
  int checked = 0;
  for (const std::string p : {"streaming", "random", "snapkv", "snapkv_pp", "chunkkv", "hbw"}) {
    for (int trial = 0; trial < 40; ++trial) {
      const int n_kv = 1 + static_cast<int>(rng() % 3), group = 1 + static_cast<int>(rng() % 3);
      const int heads = n_kv * group;
      const int window = 1 + static_cast<int>(rng() % 8);
      const int len = window + 2 + static_cast<int>(rng() % 300);
      const int budget = window + 1 + static_cast<int>(rng() % (len + 20));
      // Every parameter drawn; each policy gets the ones it takes.
      ParamValues all = {{"kernel", std::to_string(1 + 2 * (rng() % 4))},
                         {"pool", rng() % 2 ? "max" : "avg"},
                         {"chunk", std::to_string(1 + rng() % 12)},
                         {"block", std::to_string(rng() % 9)},
                         {"groups", rng() % 2 ? "1,8" : "3"},
                         {"sinks", std::to_string(rng() % 5)},
                         {"kernel_small", "3"},
                         {"kernel_large", "9"},
                         {"kernel_threshold", "150"}};
      if (p == "snapkv" && rng() % 3 == 0) all["gqa"] = "per_query_head";
      ParamValues params;
      for (const ParamInfo& q : FindPolicy(p)->params) {
        if (all.count(q.name)) params[q.name] = all[q.name];
      }
      CompressionConfig c = Config(p, budget, window, params);
      const int sinks = std::stoi(all["sinks"]);
      if (p == "streaming" && c.budget < sinks + window) c.budget = sinks + window;
      ASSERT_TRUE(c.Validate().ok()) << c.Describe() << ": " << c.Validate();
      const auto data = RandomSoftmaxScores(heads, window, len, rng);
      const WindowScores ws{data.data(), heads, window, len};
      LayerSelector sel(c, heads, n_kv);
      auto kept = sel.Select(0, len, &ws);
      ASSERT_TRUE(kept.ok()) << kept.status();
      SCOPED_TRACE(c.Describe() + " len=" + std::to_string(len));
      ASSERT_EQ(static_cast<int>(kept->size()), c.CacheHeads(heads, n_kv));
      const int want = std::min(len, c.budget);
      EXPECT_EQ(c.KeptTokens(0, len), want);
      for (const auto& row : *kept) {
        ASSERT_EQ(static_cast<int>(row.size()), want);                          // budget exactly
        for (size_t i = 1; i < row.size(); ++i) ASSERT_LT(row[i - 1], row[i]);  // sorted, unique
        ASSERT_GE(row.front(), 0);
        ASSERT_LT(row.back(), len);
        std::set<int32_t> s(row.begin(), row.end());
        for (int j = len - window; j < len; ++j) ASSERT_TRUE(s.count(j)) << "window position " << j;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 240);
}

TEST(CompressionInvariants, RatioBudget) {
  CompressionConfig c = Config("snapkv", 0, 8);
  c.ratio = 0.25;
  EXPECT_EQ(c.EffectiveBudget(400), 100);
  EXPECT_EQ(c.EffectiveBudget(20), 9);  // never below window + 1
  EXPECT_TRUE(c.Compresses(400));
  EXPECT_FALSE(c.Compresses(9));
}

// ------------------------------------------------------------------ validation

TEST(CompressionConfig, BadParametersSayWhich) {
  // Each case overlays named values on snapkv(budget=32, window=16), as a request does.
  std::string many_groups = "1";
  for (int i = 1; i < 65; ++i) many_groups += ",1";
  struct Case {
    ParamValues edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{{"budget", "0"}}, "or ratio is needed by"},
      {{{"budget", "16"}}, "must exceed the observation window"},
      {{{"kernel", "4"}}, "kernel must be odd"},
      {{{"window", "0"}}, "window must be >= 1"},
      {{{"ratio", "1.5"}}, "ratio must be in (0, 1]"},
      {{{"budget", "-1"}}, "budget must be >= 0"},
      {{{"policy", "chunkkv"}, {"chunk", "0"}}, "chunk must be >= 1"},
      {{{"policy", "chunkkv"}, {"reuse_layers", "0"}}, "reuse_layers"},
      {{{"policy", "chunkkv"}, {"gqa", "max"}}, "gqa applies to"},
      {{{"policy", "hbw"}, {"groups", ""}}, "groups"},
      {{{"policy", "hbw"}, {"groups", "1,0"}}, "groups must be >= 1"},
      {{{"policy", "hbw"}, {"block", "-2"}}, "block"},
      {{{"policy", "snapkv_pp"}, {"kernel_large", "510"}}, "kernel_large"},
      {{{"policy", "streaming"}, {"budget", "32"}, {"sinks", "20"}}, "hold the sinks"},
      {{{"skip_layers", "-1"}}, "skip_layers"},
      {{{"budget", std::to_string((1 << 30) + 1)}}, "budget must be <= 2^30"},
      {{{"window", std::to_string(kMaxWindow + 1)}}, "window must be <= 1024"},
      {{{"kernel", std::to_string((1 << 20) + 3)}}, "kernel must be <= 2^20"},
      {{{"policy", "hbw"}, {"groups", many_groups}}, "at most 64 groups"},
      // A parameter of another policy is refused, naming it.
      {{{"policy", "snapkv_pp"}, {"kernel", "7"}}, "kernel does not apply to snapkv_pp"},
      {{{"sinks", "2"}}, "sinks does not apply to snapkv"},
      {{{"policy", "full"}, {"budget", "64"}}, "budget does not apply to full"},
  };
  for (const Case& k : cases) {
    CompressionConfig c = Config("snapkv", 32, 16);
    const absl::Status st = ApplyCompressionValues(k.edit, &c);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << k.expect;
    EXPECT_NE(std::string(st.message()).find(k.expect), std::string::npos)
        << "'" << k.expect << "' not in: " << st.message();
    EXPECT_EQ(c.Describe(), Config("snapkv", 32, 16).Describe())
        << "a refused edit changes nothing";
  }
  EXPECT_EQ(MakePolicy("h2o").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(MakePolicy("h2o").status().message()).find("snapkv_pp"), std::string::npos);
  EXPECT_EQ((*MakePolicy("snapkv_pp"))->name(), "snapkv_pp");
  EXPECT_EQ((*MakePolicy("snapkv", {{"gqa", "per_query_head"}}))->CacheHeads(8, 2), 8);
  EXPECT_FALSE(MakePolicy("snapkv", {{"pool", "min"}}).ok());
}

// Every registered policy rebuilds from its own parameters, and the wire form of a config
// (CompressionValues) rebuilds the same config.
TEST(CompressionConfig, RegistryRoundTrips) {
  for (const PolicyInfo* info : Policies()) {
    SCOPED_TRACE(info->name);
    auto p = MakePolicy(info->name);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ((*p)->name(), info->name);
    std::set<std::string> names;
    for (const ParamInfo& q : info->params) names.insert(q.name);
    for (const auto& [name, value] : (*p)->params()) EXPECT_TRUE(names.count(name)) << name;
    auto again = MakePolicy(info->name, (*p)->params());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ((*again)->params(), (*p)->params());
  }
  CompressionConfig c = Config("hbw", 96, 8, {{"block", "4"}, {"groups", "1,2,4"}, {"gqa", "max"}});
  c.skip_layers = 1;
  CompressionConfig rebuilt;
  ASSERT_TRUE(ApplyCompressionValues(CompressionValues(c), &rebuilt).ok());
  EXPECT_EQ(rebuilt.Describe(), c.Describe());
  EXPECT_EQ(rebuilt.policy->params(), c.policy->params());
}

// ------------------------------------------------------------------ inside generation

TEST(CompressedGeneration, BudgetAbovePromptIsBitIdenticalToFull) {
  auto model = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model.ok());
  GenerationRequest full;
  for (int i = 0; i < 50; ++i) full.prompt_ids.push_back(3 + (i * 13) % 250);
  full.max_tokens = 12;
  full.sampling.temperature = 0.9f;
  full.seed = 5;
  auto want = Generate(**model, full);
  ASSERT_TRUE(want.ok());
  for (const std::string p : {"streaming", "random", "snapkv", "snapkv_pp", "chunkkv", "hbw"}) {
    GenerationRequest r = full;
    r.compression = Config(p, 50, 8);
    auto got = Generate(**model, r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->ids, want->ids) << p;
    EXPECT_EQ(got->logprobs, want->logprobs) << p;
    EXPECT_EQ(got->kept_cache_bytes, want->kept_cache_bytes);
  }
}

TEST(CompressedGeneration, KeepsTheBudgetAndContinuesOriginalPositions) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LlamaModel::Load(testing::StoriesModelDir());
  ASSERT_TRUE(model.ok());
  LlamaModel& m = **model;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 200; ++i) prompt.push_back(3 + (i * 7) % 500);
  CompressionConfig c = Config("snapkv", 64, 16);
  auto seq = PrefillSequence(m, prompt, c, 8);
  ASSERT_TRUE(seq.ok()) << seq.status();
  KvCache& cache = *seq->cache;
  EXPECT_EQ(cache.prompt_len(), 200);
  for (int l = 0; l < cache.num_layers(); ++l) EXPECT_EQ(cache.layer(l).len, 64);
  // Decode appends generated tokens at original positions 200, 201, ...
  std::vector<float> logits(m.config().vocab_size);
  for (int t = 0; t < 3; ++t) {
    DecodeInput in{5, 200 + t, &cache, nullptr};
    ASSERT_TRUE(m.DecodeStep({&in, 1}, logits.data()).ok());
  }
  for (int l = 0; l < cache.num_layers(); ++l) {
    const LayerCache& lc = cache.layer(l);
    ASSERT_EQ(lc.len, 67);
    for (int h = 0; h < lc.n_heads; ++h) {
      for (int t = 0; t < 3; ++t) EXPECT_EQ(lc.position(h, 64 + t), 200 + t);
      for (int t = 48; t < 64; ++t) EXPECT_EQ(lc.position(h, t), 200 - 64 + t);  // window
    }
  }
  // A per-query-head cache is n_rep times larger.
  c.policy = Make("snapkv", {{"gqa", "per_query_head"}});
  auto wide = PrefillSequence(m, prompt, c, 8);
  ASSERT_TRUE(wide.ok());
  const ModelConfig& mc = m.config();
  EXPECT_EQ(wide->cache->StoredBytes(),
            int64_t{2} * mc.num_layers * mc.num_heads * 64 * mc.head_dim * 4);  // K+V, f32
  // Prefill logits never depend on the policy: compression happens after attention.
  EXPECT_EQ(wide->logits, seq->logits);
}

}  // namespace
}  // namespace kvwire

namespace kvwire {
namespace {

// What needs the model, checked in one place for the nodes and the engines: a KV format its
// heads can take (int4 packs pairs), named as the request's field once renamed.
TEST(CompressionConfig, ValidateForRefusesAFormatTheHeadsCannotTake) {
  CompressionConfig c;
  c.kv_format = KvFormat::kInt4;
  EXPECT_TRUE(c.ValidateFor(2, 8).ok());
  const absl::Status st = RenameParams(
      c.ValidateFor(2, 7), [](absl::string_view n) { return absl::StrCat("compression.", n); });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FieldOf(st).value_or(""), "compression.kv_format") << st;
  EXPECT_NE(st.message().find("compression.kv_format int4 packs two values per byte"),
            absl::string_view::npos)
      << st;
  c.kv_format = KvFormat::kFP8;
  EXPECT_TRUE(c.ValidateFor(2, 7).ok());
}

}  // namespace
}  // namespace kvwire
