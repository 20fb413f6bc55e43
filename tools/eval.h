// Fidelity and passkey evaluation of compression policies (and, for fidelity, of the
// decode-side sparse attention modes), the harness behind `kvwire eval`.
//
// Fidelity, per prompt: greedy-generate `gen` tokens with the full cache, recording each
// step's next-token distribution and the decode-time attention over the prompt. Then,
// for every method and budget, replay the same tokens teacher-forced over the compressed
// cache and compare: top-1 agreement, KL(full ‖ compressed), and the attention-mass
// recall (share of the full-cache decode attention on prompt positions that falls on the
// kept positions; averaged over steps, layers and query heads). SnapKV's paper-exact
// hit rate (the fraction of prefix positions with attention > θ that were kept, §4 Eq.
// 4-8) is reported beside it, and the exact top-k oracle (the `budget` prompt positions
// with the most group attention at each step) gives the recall ceiling.
//
// The first generated token comes from the prefill's logits, which compression cannot
// change, so the `gen` compared predictions are those of decode steps 1..gen.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/compression/compression.h"
#include "common/model/llama_model.h"
#include "common/sparse/attention.h"
#include "tools/replay.h"

namespace kvwire::tools {

struct EvalPrompt {
  std::string id;
  std::vector<int32_t> ids;     // with BOS
  std::vector<int32_t> answer;  // passkey only
  std::string task;             // the record's "task" (passkey: single or multi), or empty
};

// Calls `each` with every non-blank line of a JSONL file, parsed, its line number and
// "path:line" for messages; stops at the first error. A line that is not JSON is
// InvalidArgument naming the file and line, a file that cannot be read NotFound.
absl::Status ForEachJsonLine(
    const std::string& path,
    const std::function<absl::Status(const nlohmann::json&, int, const std::string&)>& each);

// Reads a JSONL file with `prompt_ids` (or `prompt`, tokenized) and, for passkey,
// `answer_ids`; `id` and `task` when present. Malformed lines are errors naming the file
// and line.
absl::StatusOr<std::vector<EvalPrompt>> ReadPrompts(const std::string& path, const Tokenizer& tok,
                                                    bool need_answer);

// A method under evaluation: a name and, for a budget, how the prompt's cache is
// compressed and how decode attends over it (rocketkv is resolved per prompt).
struct EvalMethod {
  std::string name;
  std::function<CompressionConfig(int budget)> compression;
  std::function<DecodeAttentionConfig(int budget)> attention;  // null: dense
  KvFormat kv_format = KvFormat::kAuto;  // what compression(budget) codes the rows in
};

// Every method in every format (`formats` outermost within a method): the same name, each
// compression coding its rows in the format.
std::vector<EvalMethod> InFormats(const std::vector<EvalMethod>& methods,
                                  const std::vector<KvFormat>& formats);

// `method` at `budget` for a `len`-token prompt followed by `max_new` tokens; errors name
// the method.
absl::StatusOr<ResolvedMethod> ResolveMethod(const EvalMethod& method, int budget, int len,
                                             int max_new, const ModelConfig& model);
// The rows of window scores a prompt's captured prefill needs: the widest any method
// reads at any budget, and at least `at_least` (clamped to the prompt).
absl::StatusOr<int> CaptureWindow(const std::vector<EvalMethod>& methods,
                                  const std::vector<int>& budgets, int len, int max_new,
                                  int at_least, const ModelConfig& model);

struct FidelityRecord {
  std::string policy;
  std::string kv_format = "auto";
  int budget = 0;
  double agreement = 0;  // top-1 agreement with full decoding
  double kl = 0;         // mean KL(full ‖ compressed), nats
  double recall = 0;     // attention-mass recall
  double hit_rate = 0;   // SnapKV §4.2 hit rate at theta
  int n = 0;             // prompts
  int64_t predictions = 0;
};

struct FidelityOptions {
  int gen = 32;
  int window = 16;      // the prompt's last `window` tokens are not scored by the hit rate
  double theta = 0.05;  // hit-rate threshold
};

// Runs every method at every budget over the prompts; `progress(done, total)` after each
// prompt. Records come per method and budget, then one "oracle" row per budget (recall
// and hit rate only; agreement and KL are NaN).
absl::StatusOr<std::vector<FidelityRecord>> EvalFidelity(
    LlamaModel& model, const std::vector<EvalPrompt>& prompts,
    const std::vector<EvalMethod>& methods, const std::vector<int>& budgets,
    const FidelityOptions& options, const std::function<void(int, int)>& progress);

}  // namespace kvwire::tools
