// The evaluation harness's mechanics on a model whose answers we can know: the full
// policy must agree perfectly, the oracle bounds every policy's recall, passkey counts
// exact matches and skips prompts beyond the context, and bad data files are errors that
// name the file and line.
#include "tools/eval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/engine/generate.h"
#include "common/wire/kv_wire.h"
#include "tests/engine_fakes.h"
#include "tests/test_util.h"
#include "tools/passkey.h"

namespace kvwire::tools {
namespace {

// The method `name` is the policy of that name.
EvalMethod Method(const std::string& name, int window = 8) {
  const PolicyPtr p = *MakePolicy(name);
  return {name, [p, window](int budget) {
            CompressionConfig c;
            c.policy = p;
            if (p->evicts()) {
              c.budget = budget;
              c.window = window;
            }
            return c;
          }};
}

std::vector<EvalPrompt> SyntheticPrompts(int n, int len) {
  std::vector<EvalPrompt> out;
  for (int i = 0; i < n; ++i) {
    EvalPrompt p;
    p.id = absl::StrCat("p", i);  // (operator+ trips a GCC 12 -Wrestrict false positive)
    p.ids.push_back(1);
    for (int t = 1; t < len; ++t) p.ids.push_back(3 + (t * (7 + i)) % 250);
    out.push_back(p);
  }
  return out;
}

TEST(EvalFidelity, FullAgreesPerfectlyAndOracleBoundsRecall) {
  auto model = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model.ok());
  const auto prompts = SyntheticPrompts(3, 120);
  FidelityOptions opts;
  opts.gen = 8;
  opts.window = 8;
  int calls = 0;
  auto records =
      EvalFidelity(**model, prompts, {Method("full"), Method("snapkv"), Method("random")},
                   {16, 64, 500}, opts, [&](int done, int total) {
                     EXPECT_EQ(total, 3);
                     EXPECT_EQ(done, ++calls);
                   });
  ASSERT_TRUE(records.ok()) << records.status();
  EXPECT_EQ(calls, 3);
  ASSERT_EQ(records->size(), 4u * 3u);  // three methods and the oracle, three budgets each
  std::map<std::pair<std::string, int>, FidelityRecord> by;
  for (const auto& r : *records) by[{r.policy, r.budget}] = r;
  for (int b : {16, 64, 500}) {
    const FidelityRecord& full = by[{"full", b}];
    EXPECT_EQ(full.agreement, 1.0);
    EXPECT_NEAR(full.kl, 0.0, 1e-9);
    EXPECT_NEAR(full.recall, 1.0, 1e-6);
    EXPECT_EQ(full.n, 3);
    EXPECT_EQ(full.predictions, 24);
    const FidelityRecord& oracle = by[{"oracle", b}];
    EXPECT_TRUE(std::isnan(oracle.agreement));
    for (const char* p : {"snapkv", "random"}) {
      const FidelityRecord& r = by[{p, b}];
      EXPECT_GE(r.kl, 0.0) << p;
      EXPECT_LE(r.recall, oracle.recall + 1e-9) << p << " at " << b;
      EXPECT_GE(r.agreement, 0.0);
      EXPECT_LE(r.agreement, 1.0);
    }
  }
  // A budget above the prompt keeps everything.
  const auto at = [&](const char* policy, int budget) { return by[{policy, budget}]; };
  EXPECT_EQ(at("snapkv", 500).agreement, 1.0);
  EXPECT_NEAR(at("oracle", 500).recall, 1.0, 1e-6);
  // Recall grows with the budget.
  EXPECT_LT(at("snapkv", 16).recall, at("snapkv", 64).recall);
}

TEST(EvalFidelity, PromptBeyondContextIsAnError) {
  auto model = LlamaModel::Load("synthetic:tiny,context=128");
  ASSERT_TRUE(model.ok());
  FidelityOptions opts;
  opts.gen = 16;
  auto r = EvalFidelity(**model, SyntheticPrompts(1, 120), {Method("full")}, {32}, opts, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.status().message()).find("context"), std::string::npos);
}

TEST(EvalPasskey, CountsExactMatchesAndSkipsLongPrompts) {
  auto model_or = LlamaModel::Load("synthetic:tiny,context=256");
  ASSERT_TRUE(model_or.ok());
  LlamaModel& model = **model_or;
  // The "answer" of each prompt is the model's own greedy continuation with the full
  // cache, so full must score 100%; one prompt is too long for the context.
  std::vector<EvalPrompt> prompts = SyntheticPrompts(3, 100);
  for (EvalPrompt& p : prompts) {
    GenerationRequest req;
    req.prompt_ids = p.ids;
    req.max_tokens = 5;
    req.sampling.temperature = 0;
    auto r = Generate(model, req);
    ASSERT_TRUE(r.ok());
    p.answer = r->ids;
    p.task = p.id == "p1" ? "multi" : "single";
  }
  EvalPrompt too_long = SyntheticPrompts(1, 254)[0];
  too_long.id = "long";
  too_long.answer = {5, 6, 7};
  prompts.push_back(too_long);
  int calls = 0;
  auto run = EvalPasskey(model, prompts, {Method("full"), Method("streaming")}, {20, 300}, 8,
                         [&](int done, int total) {
                           EXPECT_EQ(total, 4);
                           EXPECT_EQ(done, ++calls);
                         });
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(calls, 4);
  EXPECT_EQ(run->skipped, std::vector<std::string>{"long"});
  ASSERT_EQ(run->answers.size(), 3u * 4u);
  for (const PasskeyAnswer& a : run->answers) {
    EXPECT_EQ(a.prompt_tokens, 100);
    EXPECT_EQ(a.full_cache_bytes, 100 * model.config().KvBytesPerToken(model.kv_dtype()));
    if (a.method == "full" || a.budget == 300) {
      EXPECT_TRUE(a.correct()) << a.id << " " << a.method << " " << a.budget;
    }
    // The bytes a stream of the cache carries: every kept row's K and V, and the positions
    // coded compactly (docs/wire_format.md): all 100 positions as a bitmap of 13 bytes behind
    // 3 bytes of coding, 20 of them in at most one byte each behind the coding's.
    const int kept = a.method == "full" || a.budget >= 100 ? 100 : a.budget;
    const int64_t heads = int64_t{model.config().num_layers} * model.config().num_kv_heads;
    const int64_t kv = heads * kept * 2 * model.config().head_dim * DTypeSize(model.kv_dtype());
    if (kept == 100) {
      std::vector<int32_t> all(100);
      for (int i = 0; i < 100; ++i) all[i] = i;
      std::string coded;
      EncodePositions(all.data(), 100, &coded);
      EXPECT_EQ(coded.size(), 16u);
      EXPECT_EQ(a.kv_payload_bytes, kv + heads * 16) << a.method;
    } else {
      EXPECT_GT(a.kv_payload_bytes, kv + heads * 3) << a.method;
      EXPECT_LE(a.kv_payload_bytes, kv + heads * (1 + kept)) << a.method;
    }
  }
  const std::vector<PasskeyRow> rows = SummarizePasskey(run->answers);
  // Per method and budget: all, the two tasks, one length bucket (100 tokens: <= 512).
  ASSERT_EQ(rows.size(), 4u * 4u);
  EXPECT_EQ(rows[0].method, "full");
  EXPECT_EQ(rows[0].task, "all");
  EXPECT_EQ(rows[0].n, 3);
  EXPECT_EQ(rows[0].accuracy(), 1.0);
  EXPECT_EQ(rows[1].task, "multi");
  EXPECT_EQ(rows[1].n, 1);
  EXPECT_EQ(rows[2].task, "single");
  EXPECT_EQ(rows[2].n, 2);
  EXPECT_EQ(rows[3].length, 512);
  EXPECT_EQ(rows[3].n, 3);
}

// A method reading a narrower window than the prefill captured sees exactly what a prefill
// with its own window gives it: the same kept positions and K/V.
TEST(Replay, NarrowerWindowEqualsItsOwnPrefill) {
  auto model = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model.ok());
  const ModelConfig& mc = (*model)->config();
  const EvalPrompt prompt = SyntheticPrompts(1, 150)[0];
  CapturedPrefill cap(32, mc);
  ASSERT_TRUE((*model)->Prefill(prompt.ids, &cap).status().ok());
  for (const char* policy : {"snapkv", "hbw", "chunkkv"}) {
    CompressionConfig c;
    c.policy = *MakePolicy(policy);
    c.budget = 40;
    c.window = 8;
    auto replayed = ReplayInto(**model, cap, c, 0);
    ASSERT_TRUE(replayed.ok()) << replayed.status();
    auto direct = KvCache::Create(CompressedCacheShape(c, mc, (*model)->kv_dtype(), 150, 0),
                                  HeapKvAllocator());
    ASSERT_TRUE(direct.ok());
    testing::CacheSink sink(direct->get());
    Compressor compressor(c, mc, (*model)->kv_dtype(), &sink);
    ASSERT_TRUE((*model)->Prefill(prompt.ids, &compressor).status().ok());
    EXPECT_EQ(testing::CacheDifference(*replayed->cache, **direct), "") << policy;
  }
  // More rows than were captured is an error, not a silent shorter window.
  CompressionConfig wide;
  wide.policy = *MakePolicy("snapkv");
  wide.budget = 80;
  wide.window = 64;
  EXPECT_EQ(ReplayInto(**model, cap, wide, 0).status().code(), absl::StatusCode::kInternal);
}

TEST(ComparePasskey, ReportsEveryDifference) {
  PasskeyAnswer a;
  a.id = "p0";
  a.method = "snapkv";
  a.budget = 64;
  a.expected = {5, 6};
  a.tokens = {5, 6};
  a.kv_payload_bytes = 1000;
  const std::string dir = testing::MakeTempDir("compare");
  testing::WriteFile(dir + "/ref.jsonl", ToJson(a).dump() + "\n");
  auto same = ComparePasskey({a}, dir + "/ref.jsonl");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->empty());
  PasskeyAnswer b = a;
  b.tokens = {5, 7};
  b.kv_payload_bytes = 1004;
  PasskeyAnswer c = a;
  c.budget = 128;
  PasskeyAnswer d = a;  // the same method in another format is another answer
  d.kv_format = "fp8";
  auto diffs = ComparePasskey({b, c, d}, dir + "/ref.jsonl");
  ASSERT_TRUE(diffs.ok());
  ASSERT_EQ(diffs->size(), 4u);
  EXPECT_EQ((*diffs)[0], "p0 snapkv in auto at 64: answered [5 7], the reference [5 6]");
  EXPECT_EQ((*diffs)[1], "p0 snapkv in auto at 64: 1004 KV payload bytes, the reference 1000");
  EXPECT_NE((*diffs)[2].find("p0 snapkv in auto at 128: not in"), std::string::npos);
  EXPECT_NE((*diffs)[3].find("p0 snapkv in fp8 at 64: not in"), std::string::npos);
  // A reference from before formats (no kv_format) holds answers in auto.
  nlohmann::json old = ToJson(a);
  old.erase("kv_format");
  testing::WriteFile(dir + "/old.jsonl", old.dump() + "\n");
  auto from_old = ComparePasskey({a}, dir + "/old.jsonl");
  ASSERT_TRUE(from_old.ok()) << from_old.status();
  EXPECT_TRUE(from_old->empty());
  testing::WriteFile(dir + "/bad.jsonl", "{\"id\": \"p0\"}\n");
  auto bad = ComparePasskey({a}, dir + "/bad.jsonl");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("bad.jsonl:1"), std::string::npos);
}

// The retrieval model of ../shared: with the full cache it answers, the needle is found in
// layer 2, KV head 1 (its README's induction head), and SnapKV at 128 keeps it.
TEST(EvalPasskey, FindsTheNeedleOfTheRetrievalModel) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LlamaModel::Load(testing::SharedDir() + "/models/passkey-induction-hf");
  ASSERT_TRUE(model.ok()) << model.status();
  auto prompts =
      ReadPrompts(testing::SharedDir() + "/data/passkey/dev.jsonl", (*model)->tokenizer(), true);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  prompts->resize(2);
  auto run = EvalPasskey(**model, *prompts, {Method("full", 16), Method("snapkv", 16)}, {128}, 16,
                         nullptr);
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->answers.size(), 4u);
  for (const PasskeyAnswer& a : run->answers) {
    EXPECT_TRUE(a.correct()) << a.id << " " << a.method;
    EXPECT_TRUE(a.task == "single" || a.task == "multi") << a.task;
    EXPECT_EQ(a.retrieval_layer, 2);
    EXPECT_EQ(a.retrieval_kv_head, 1);
    EXPECT_GT(a.needle_share, 0.1);
    EXPECT_EQ(a.needle_kept, 1);
    EXPECT_EQ(a.needle_read, 1);
  }
}

TEST(ReadPrompts, ErrorsNameTheFileAndLine) {
  auto model = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model.ok());
  const Tokenizer& tok = (*model)->tokenizer();
  const std::string dir = testing::MakeTempDir("prompts");
  struct Case {
    std::string contents;
    bool answer;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"{\"prompt_ids\": [1, 2]}\n{oops\n", false, "data.jsonl:2: not valid JSON"},
      {"{\"id\": \"a\"}\n", false, "expected \"prompt_ids\" or \"prompt\""},
      {"{\"prompt_ids\": [1, -4]}\n", false, "non-negative token ids"},
      {"{\"prompt_ids\": [1, 99999]}\n", false, "outside the model's vocabulary"},
      {"{\"prompt_ids\": [1, 2]}\n", true, "expected \"answer_ids\""},
      {"\n\n", false, "no prompts"},
  };
  for (const Case& c : cases) {
    testing::WriteFile(dir + "/data.jsonl", c.contents);
    auto r = ReadPrompts(dir + "/data.jsonl", tok, c.answer);
    ASSERT_FALSE(r.ok()) << c.contents;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(r.status().message()).find(c.expect), std::string::npos)
        << r.status().message();
  }
  testing::WriteFile(dir + "/data.jsonl", "{\"id\": \"x\", \"prompt\": \"hi\"}\n");
  auto ok = ReadPrompts(dir + "/data.jsonl", tok, false);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0].id, "x");
  EXPECT_EQ((*ok)[0].ids, *tok.Encode("hi"));
  EXPECT_EQ(ReadPrompts(dir + "/missing.jsonl", tok, false).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(EvalFidelity, StoriesDevPromptsLoad) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LlamaModel::Load(testing::StoriesModelDir());
  ASSERT_TRUE(model.ok());
  auto prompts =
      ReadPrompts(testing::SharedDir() + "/data/stories/dev.jsonl", (*model)->tokenizer(), false);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  EXPECT_EQ(prompts->size(), 100u);
  auto passkey =
      ReadPrompts(testing::SharedDir() + "/data/passkey/dev.jsonl", (*model)->tokenizer(), true);
  ASSERT_TRUE(passkey.ok()) << passkey.status();
  EXPECT_EQ(passkey->size(), 200u);
}

}  // namespace
}  // namespace kvwire::tools
