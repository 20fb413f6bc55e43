// The prefix cache on one prefill engine: a second question on the same document against the
// first, which computed it all. Per document, in this order, on one model:
//   cold  a question on an engine without a cache (the answer to compare with)
//   first a question on an engine with a cache (a miss: it computes the document and fills it)
//   second another question on the same document (the document's blocks from the cache)
// and the table gives the prefill time of first and second (the part of TTFT the cache
// removes), their ratio, the tokens found cached, and whether second's greedy answer equals
// cold's (and the dataset's, for passkey prompts). A benchmark, not a test.
//
//   build/bench/prefix_bench --model ../shared/models/passkey-induction-hf
//       --data ../shared/data/passkey/dev.jsonl [--limit 40] [--min-tokens 1800]
//       [--policies full,snapkv] [--budget 128] [--block-tokens 64] [--threads 2]
//   build/bench/prefix_bench --model synthetic:llama-1b,dtype=bf16 --document-tokens 4096
//       [--documents 2] [--question-tokens 16]
// (each one command line)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/flags.h"
#include "common/base/status.h"
#include "common/engine/generate.h"
#include "common/engine/prefill_engine.h"

namespace kvwire {
namespace {

struct Document {
  std::string id;
  std::vector<int32_t> first, second;  // the two questions' prompts
  std::vector<int32_t> answer;         // the dataset's (passkey), or empty
};

// The document `doc` asked `q1`, then `q2`.
Document Ask(std::string id, const std::vector<int32_t>& doc, const std::vector<int32_t>& q1,
             const std::vector<int32_t>& q2) {
  Document d;
  d.id = std::move(id);
  d.first = doc;
  d.first.insert(d.first.end(), q1.begin(), q1.end());
  d.second = doc;
  d.second.insert(d.second.end(), q2.begin(), q2.end());
  return d;
}

// Passkey prompts end with the question ("What is the secret number? The secret number is");
// the second question asks it in other words ("Tell me the secret number. The secret number
// is"). The document and each question are tokenized apart, so both prompts share its tokens.
absl::StatusOr<std::vector<Document>> PasskeyDocuments(const LlamaModel& model,
                                                       const std::string& path, int limit,
                                                       int min_tokens) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<Document> out;
  std::string line;
  while (std::getline(in, line) && static_cast<int>(out.size()) < limit) {
    const auto j = nlohmann::json::parse(line);
    const std::string id = j["id"].get<std::string>();
    const std::string prompt = j["prompt"].get<std::string>();
    const size_t at = prompt.rfind("What is ");
    const size_t mark = at == std::string::npos ? at : prompt.find("? ", at);
    if (mark == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(id, ": the prompt does not end with a question 'What is ...? ...'"));
    }
    const std::string subject = prompt.substr(at + 8, mark - at - 8);
    const std::string answer_start = prompt.substr(mark + 2);
    ASSIGN_OR_RETURN(const std::vector<int32_t> doc,
                     model.tokenizer().Encode(prompt.substr(0, at), true));
    ASSIGN_OR_RETURN(const std::vector<int32_t> q1,
                     model.tokenizer().Encode(prompt.substr(at), false));
    ASSIGN_OR_RETURN(
        const std::vector<int32_t> q2,
        model.tokenizer().Encode(absl::StrCat("Tell me ", subject, ". ", answer_start), false));
    if (static_cast<int>(doc.size()) < min_tokens) continue;
    out.push_back(Ask(id, doc, q1, q2));
    out.back().answer = j["answer_ids"].get<std::vector<int32_t>>();
  }
  return out;
}

// Random documents of `tokens` tokens, each with two random questions.
std::vector<Document> SyntheticDocuments(const LlamaModel& model, int documents, int tokens,
                                         int question) {
  std::mt19937 rng(7);
  const int vocab = model.config().vocab_size;
  auto draw = [&](int n) {
    std::vector<int32_t> ids(n);
    for (int32_t& id : ids) id = static_cast<int32_t>(3 + rng() % (vocab - 3));
    return ids;
  };
  std::vector<Document> out;
  for (int i = 0; i < documents; ++i) {
    const std::vector<int32_t> doc = draw(tokens), q1 = draw(question), q2 = draw(question);
    out.push_back(Ask(absl::StrCat("synthetic-", i), doc, q1, q2));
  }
  return out;
}

int Run(int argc, char** argv) {
  Flags flags;
  flags.Define("model", "", "model folder or synthetic:NAME");
  flags.Define("data", "", "passkey JSONL (the second question asks the first in other words)");
  flags.Define("limit", "40", "passkey prompts at most");
  flags.Define("min-tokens", "0", "passkey prompts of at least this many tokens");
  flags.Define("document-tokens", "4096", "without --data: random documents of this many tokens");
  flags.Define("documents", "2", "without --data: how many");
  flags.Define("question-tokens", "16", "without --data: tokens per random question");
  flags.Define("policies", "full,snapkv", "compression policies, comma-separated");
  flags.Define("budget", "128", "budget of the policies that take one");
  flags.Define("block-tokens", "64", "tokens per prefix cache block");
  flags.Define("max-tokens", "6", "tokens generated per question (the answer compared)");
  flags.Define("threads", "2", "CPU threads");
  if (absl::Status st = flags.Parse(argc, argv); !st.ok()) {
    std::fprintf(stderr, "prefix_bench: %s\n", std::string(st.message()).c_str());
    return 2;
  }
  auto fail = [](const absl::Status& st) {
    std::fprintf(stderr, "prefix_bench: %s\n", std::string(st.message()).c_str());
    return 1;
  };
  LoadOptions load;
  auto threads = flags.GetInt("threads", 1, 256);
  auto limit = flags.GetInt("limit", 1, 1 << 20);
  auto min_tokens = flags.GetInt("min-tokens", 0, 1 << 20);
  auto doc_tokens = flags.GetInt("document-tokens", 1, 1 << 20);
  auto documents = flags.GetInt("documents", 1, 1000);
  auto question = flags.GetInt("question-tokens", 1, 4096);
  auto budget = flags.GetInt("budget", 1, 1 << 20);
  auto block = flags.GetInt("block-tokens", 1, 4096);
  auto max_tokens = flags.GetInt("max-tokens", 1, 4096);
  for (const absl::Status& st : {threads.status(), limit.status(), min_tokens.status(),
                                 doc_tokens.status(), documents.status(), question.status(),
                                 budget.status(), block.status(), max_tokens.status()}) {
    if (!st.ok()) return fail(st);
  }
  load.threads = static_cast<int>(*threads);
  auto model = LlamaModel::Load(flags.GetString("model"), load);
  if (!model.ok()) return fail(model.status());
  LlamaModel& m = **model;
  absl::StatusOr<std::vector<Document>> docs =
      flags.GetString("data").empty()
          ? SyntheticDocuments(m, static_cast<int>(*documents), static_cast<int>(*doc_tokens),
                               static_cast<int>(*question))
          : PasskeyDocuments(m, flags.GetString("data"), static_cast<int>(*limit),
                             static_cast<int>(*min_tokens));
  if (!docs.ok()) return fail(docs.status());
  if (docs->empty()) return fail(absl::InvalidArgumentError("no documents"));

  std::printf("model %s, %zu documents, blocks of %d tokens\n", m.description().c_str(),
              docs->size(), static_cast<int>(*block));
  std::printf("%-10s %8s %10s %10s %7s %8s %12s %12s\n", "policy", "prompt", "first_ms",
              "second_ms", "ratio", "cached", "same_answer", "dataset_ok");
  int mismatches = 0;
  for (absl::string_view policy_name :
       absl::StrSplit(flags.GetString("policies"), ',', absl::SkipEmpty())) {
    auto policy = MakePolicy(std::string(policy_name));
    if (!policy.ok()) return fail(policy.status());
    // A cache that holds every document: this measures hits, not eviction.
    PrefillEngineOptions cached_options;
    cached_options.node_name = "cached";
    cached_options.workers = 0;
    cached_options.prefix_block_tokens = static_cast<int>(*block);
    cached_options.prefix_cache_bytes = size_t{8} << 30;
    PrefillEngine plain(&m, {.node_name = "plain", .workers = 0});
    PrefillEngine cached(&m, cached_options);
    double first_sum = 0, second_sum = 0;
    std::vector<double> ratios;
    int same = 0, right = 0, scored = 0;
    int64_t prompt_tokens = 0, cached_tokens = 0;
    for (size_t i = 0; i < docs->size(); ++i) {
      const Document& d = (*docs)[i];
      auto request = [&](const std::vector<int32_t>& ids, PrefillEngine* engine) {
        GenerationRequest r;
        r.prompt_ids = ids;
        r.max_tokens = static_cast<int>(*max_tokens);
        r.compression.policy = *policy;
        if (policy_name != "full") r.compression.budget = static_cast<int>(*budget);
        r.prefill = engine;
        return Generate(m, r);
      };
      if (i == 0) {  // warms the pages and threads, on the uncached engine only
        if (auto w = request(d.second, &plain); !w.ok()) return fail(w.status());
      }
      auto cold = request(d.second, &plain);
      auto first = request(d.first, &cached);
      auto second = request(d.second, &cached);
      for (const auto* r : {&cold, &first, &second}) {
        if (!r->ok()) return fail(r->status());
      }
      first_sum += first->prefill_seconds;
      second_sum += second->prefill_seconds;
      ratios.push_back(second->prefill_seconds / first->prefill_seconds);
      prompt_tokens += static_cast<int64_t>(d.second.size());
      cached_tokens += second->cached_tokens;
      same += second->ids == cold->ids;
      mismatches += second->ids != cold->ids;
      if (!d.answer.empty()) {
        ++scored;
        const size_t n = std::min(d.answer.size(), second->ids.size());
        right += std::equal(d.answer.begin(), d.answer.begin() + n, second->ids.begin());
      }
    }
    std::sort(ratios.begin(), ratios.end());
    const int n = static_cast<int>(docs->size());
    std::printf("%-10s %8lld %10.1f %10.1f %7.3f %7.1f%% %7d/%-4d %7s\n",
                std::string(policy_name).c_str(), static_cast<long long>(prompt_tokens / n),
                1e3 * first_sum / n, 1e3 * second_sum / n, ratios[ratios.size() / 2],
                100.0 * cached_tokens / prompt_tokens, same, n,
                scored ? absl::StrCat(right, "/", scored).c_str() : "-");
  }
  std::printf("(times: means of the prefill; ratio: median of second / first per document)\n");
  return mismatches == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) { return kvwire::Run(argc, argv); }
