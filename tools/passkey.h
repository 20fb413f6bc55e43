// Passkey retrieval (needle in a haystack), the evaluation behind `kvwire eval passkey`:
// each prompt hides a number (the needle) and asks for it at the end; a method answers
// right when its greedy continuation equals the answer exactly. The first answer token
// comes from the prefill's logits (the full prompt), the rest from decode steps over the
// method's cache.
//
// Besides the answer, each prompt records what explains it:
//  - the needle: the answer's last occurrence in the prompt, and the retrieval head, the
//    (layer, KV head) whose observation window puts the largest share of its full-cache
//    attention on the needle (in ../shared/models/passkey-induction-hf that is layer 2,
//    KV head 1, where the induction head reads the digits). "Needle kept" means every
//    needle position survived the compression in every cache head of that KV head;
//    "needle read" that each decode step attended, in those heads, the needle token it was
//    to produce (answer token t sits at needle position t): what sparse attention adds,
//    since it reads a subset of the cache at each step.
//  - the bytes: the full cache's K and V, and what the compressed stream carries (the
//    chunks' positions, K and V: docs/wire_format.md); their quotient is the compression
//    ratio. Through the service pair the response's figures give the same two numbers
//    and the bytes of the KV messages on the wire.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/eval.h"

namespace kvwire::tools {

// The length bucket of a prompt: its token count rounded up to a multiple of 512.
int LengthBucket(int tokens);

struct PasskeyAnswer {
  std::string id, task;  // task: the prompt's (single, multi), or empty
  std::string method;
  std::string kv_format = "auto";
  int budget = 0;
  int prompt_tokens = 0;
  std::vector<int32_t> expected, tokens;
  bool correct() const { return tokens == expected; }
  // In process: 1 or 0 (-1 when the answer does not occur in the prompt); through the pair
  // -1 (not observable).
  int needle_kept = -1;
  int needle_read = -1;          // likewise: each step attended the needle token it produces
  std::vector<int> needle_lost;  // offsets within the needle of the positions evicted
  int needle_start = -1;         // the needle's first prompt position
  int retrieval_layer = -1, retrieval_kv_head = -1;
  double needle_share = -1;         // of the retrieval head's window attention, on the needle
  std::vector<double> needle_mass;  // that share, token by token
  int64_t full_cache_bytes = 0;
  int64_t full_bf16_bytes = 0;  // the full cache in bf16, however the model's is stored
  int64_t kv_payload_bytes = 0;
  int64_t wire_bytes = -1;  // through the pair: bytes of the KV messages received
  // Through the pair: the decode node's time to first token and the prompt tokens its prefill
  // node's prefix cache held; with a warm pass, the same of the prompt's second request and its
  // answer.
  double ttft_ms = -1, warm_ttft_ms = -1;
  int cached_tokens = -1, warm_cached_tokens = -1;
  std::vector<int32_t> warm_tokens;
};

struct PasskeyRun {
  std::vector<PasskeyAnswer> answers;  // per prompt, then method, then budget
  std::vector<std::string> skipped;    // ids of prompts longer than the model's context
};

// In process: one prefill per prompt, replayed through every method at every budget.
// `window` is the observation window the retrieval head is measured over (and the least
// one captured).
absl::StatusOr<PasskeyRun> EvalPasskey(LlamaModel& model, const std::vector<EvalPrompt>& prompts,
                                       const std::vector<EvalMethod>& methods,
                                       const std::vector<int>& budgets, int window,
                                       const std::function<void(int, int)>& progress);

// One table row: a method at a budget over the prompts of one task ("all") and one length
// bucket (0: all).
struct PasskeyRow {
  std::string method;
  std::string kv_format = "auto";
  int budget = 0;
  std::string task = "all";
  int length = 0;
  int n = 0, correct = 0;
  int needle_n = 0, needle_kept = 0;  // prompts whose needle was measured, and kept
  int needle_read = 0;
  int64_t full_cache_bytes = 0, full_bf16_bytes = 0, kv_payload_bytes = 0;
  int64_t wire_bytes = -1;  // summed when every answer has it
  double accuracy() const;
  double needle_kept_share() const;  // NaN when none was measured
  double needle_read_share() const;
  double ratio() const;       // full ÷ payload
  double ratio_bf16() const;  // the full cache in bf16 ÷ payload
  double wire_ratio() const;  // full ÷ wire bytes, NaN without them
};

// Per method, format and budget (in the answers' order): the row over all prompts, then one per
// task, then one per length bucket.
std::vector<PasskeyRow> SummarizePasskey(const std::vector<PasskeyAnswer>& answers);

nlohmann::json ToJson(const PasskeyRow& row);
nlohmann::json ToJson(const PasskeyAnswer& answer);

// Compares two runs' answers prompt for prompt (matched by id, method and budget): the
// tokens and the KV payload bytes must be equal and every answer of `run` must have a
// counterpart in `reference` (a JSONL file of ToJson(PasskeyAnswer) records; matched by id,
// method, kv_format — "auto" where a record has none — and budget). Returns the
// differences, one line each (empty: the runs agree).
absl::StatusOr<std::vector<std::string>> ComparePasskey(const std::vector<PasskeyAnswer>& run,
                                                        const std::string& reference_path);

}  // namespace kvwire::tools
