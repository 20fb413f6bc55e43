// `kvwire timing`, which bench/peers uses to time kvwire against llama.cpp: the ids it reports
// are the ids greedy generation produces (stories260K's reference ids where ../shared is
// present), the times are the run's, and bad flags are usage errors that name the flag.
#include "tools/timing.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/engine/generate.h"
#include "tests/test_util.h"
#include "tools/commands.h"

namespace kvwire::tools {
namespace {

using nlohmann::json;

std::vector<int32_t> Prompt(int len) {
  std::vector<int32_t> ids = {1};
  for (int t = 1; t < len; ++t) ids.push_back(3 + (t * 37) % 300);
  return ids;
}

TEST(TimeGreedyGeneration, IdsAreThoseOfGreedyGenerate) {
  auto model = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<int32_t> prompt = Prompt(40);
  auto timed = TimeGreedyGeneration(**model, prompt, 12);
  ASSERT_TRUE(timed.ok()) << timed.status();
  GenerationRequest req;
  req.prompt_ids = prompt;
  req.max_tokens = 13;
  req.sampling.temperature = 0;
  auto reference = Generate(**model, req);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(timed->ids, reference->ids);
  EXPECT_GT(timed->prefill_seconds, 0);
  EXPECT_GT(timed->decode_seconds, 0);

  auto prefill_only = TimeGreedyGeneration(**model, prompt, 0);
  ASSERT_TRUE(prefill_only.ok()) << prefill_only.status();
  EXPECT_EQ(prefill_only->ids, std::vector<int32_t>{reference->ids[0]});
}

TEST(TimeGreedyGeneration, StoriesReproducesTheReferenceFromBos) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LlamaModel::Load(testing::StoriesModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  const json ref = json::parse(testing::ReadFile(testing::StoriesModelDir() + "/REFERENCE.json"));
  const auto expected = ref["greedy_from_bos"]["ids"].get<std::vector<int32_t>>();
  ASSERT_GE(expected.size(), 2u);
  auto timed =
      TimeGreedyGeneration(**model, std::vector<int32_t>{1}, static_cast<int>(expected.size()) - 1);
  ASSERT_TRUE(timed.ok()) << timed.status();
  EXPECT_EQ(timed->ids, expected);
}

TEST(TimeGreedyGeneration, RefusesWhatCannotRun) {
  auto model = LlamaModel::Load("synthetic:tiny,context=64");
  ASSERT_TRUE(model.ok()) << model.status();
  const int context = (*model)->config().context_limit();
  EXPECT_EQ(TimeGreedyGeneration(**model, {}, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TimeGreedyGeneration(**model, Prompt(8), -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The prompt and the steps' tokens must fit in the context.
  EXPECT_TRUE(TimeGreedyGeneration(**model, Prompt(context - 3), 2).ok());
  EXPECT_EQ(TimeGreedyGeneration(**model, Prompt(context - 3), 3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParseTokenIds, ErrorsNameTheIdAndTheVocabulary) {
  auto ids = ParseTokenIds("1,0,511", 512);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{1, 0, 511}));
  for (const char* bad : {"", "1,,2", "1,x", "-1", "512", "99999999999"}) {
    auto r = ParseTokenIds(bad, 512);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseTokenIds("5,512", 512).status().message(),
            "token id '512' (position 1) is not an integer in [0, 512)");
}

// Runs `kvwire timing ARGS`; returns the exit code and what it printed on stdout.
int RunCommand(std::vector<std::string> args, std::string* out) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  const int rc = RunTiming(static_cast<int>(argv.size()), argv.data());
  *out = ::testing::internal::GetCapturedStdout();
  return rc;
}

TEST(TimingCommand, PrintsEveryRunAsJson) {
  std::string out;
  ASSERT_EQ(RunCommand({"--model", "synthetic:tiny", "--prompt-ids", "1,40,41,42,43", "--decode",
                        "6", "--runs", "2", "--threads", "1"},
                       &out),
            0);
  const json j = json::parse(out);
  EXPECT_EQ(j["prompt_tokens"], 5);
  EXPECT_EQ(j["decode_steps"], 6);
  EXPECT_EQ(j["threads"], 1);
  ASSERT_EQ(j["runs"].size(), 2u);
  for (const json& run : j["runs"]) {
    EXPECT_GT(run["prefill_seconds"].get<double>(), 0);
    EXPECT_GT(run["decode_seconds"].get<double>(), 0);
    EXPECT_EQ(run["ids"].size(), 7u);
  }
  EXPECT_EQ(j["runs"][0]["ids"], j["runs"][1]["ids"]);  // greedy: the same every run
}

// With a compression and a sparse decode attention on the guarded backend (the device path on
// the CPU), the JSON reports what crossed between host and backend: the prefill's kept rows,
// positions and last logits, and per decode step the sampled token and its log-probability.
TEST(TimingCommand, ReportsTheCopiesOfADevicePath) {
  std::string ids = "1";
  for (int i = 1; i < 300; ++i) absl::StrAppend(&ids, ",", 5 + (i * 37) % 300);
  std::string out;
  ASSERT_EQ(RunCommand({"--model", "synthetic:tiny", "--backend", "guarded", "--prompt-ids", ids,
                        "--decode", "4", "--policy", "snapkv", "--budget", "64", "--attention",
                        "hybrid", "--attention-budget", "32", "--threads", "1"},
                       &out),
            0);
  const json j = json::parse(out);
  EXPECT_EQ(j["backend"], "guarded");
  EXPECT_EQ(j["compression"], "snapkv(budget=64, window=16, pool=max, kernel=7, gqa=sum)");
  EXPECT_EQ(j["attention"], "hybrid(t=32)");
  // synthetic:tiny: 2 layers, 2 KV heads of 16 f32 values, a vocabulary of 320.
  const double payload = 2 * 2 * 64 * (4 + 2 * 16 * 4);
  const json& prefill = j["copies"]["prefill"];
  EXPECT_GE(prefill["to_host_bytes"].get<double>(), payload);
  EXPECT_LE(prefill["to_host_bytes"].get<double>(), 1.1 * payload + 320 * 4);
  const json& step = j["copies"]["decode_step"];
  EXPECT_LE(step["to_host_bytes"].get<double>(), 16);
  EXPECT_EQ(step["to_host_calls"].get<double>(), 1);
  EXPECT_GT(step["to_device_bytes"].get<double>(), 0);  // the inputs, the prompt's rows
}

TEST(TimingCommand, BadFlagsAreUsageErrors) {
  std::string out;
  EXPECT_EQ(RunCommand({"--model", "synthetic:tiny"}, &out), 2);  // no --prompt-ids
  EXPECT_EQ(
      RunCommand({"--model", "synthetic:tiny", "--prompt-ids", "1,2", "--decode", "-1"}, &out), 2);
  EXPECT_EQ(RunCommand({"--model", "synthetic:tiny", "--prompt-ids", "1,2", "--runs", "0"}, &out),
            2);
  EXPECT_EQ(RunCommand({"--model", "synthetic:tiny", "--prompt-ids", "1,320"}, &out), 2);
  EXPECT_EQ(
      RunCommand({"--model", "synthetic:tiny", "--prompt-ids", "1,2", "--decode", "5000"}, &out),
      2);
  // rocketkv sets its own attention; an attention parameter another mode takes is refused.
  EXPECT_EQ(RunCommand({"--model", "synthetic:tiny", "--prompt-ids", "1,2", "--policy", "rocketkv",
                        "--budget", "64", "--attention", "quest"},
                       &out),
            2);
  EXPECT_EQ(RunCommand({"--model", "synthetic:tiny", "--prompt-ids", "1,2", "--attention", "quest",
                        "--attention-budget", "32", "--attention-r", "4"},
                       &out),
            2);
  EXPECT_EQ(out, "");
}

}  // namespace
}  // namespace kvwire::tools
