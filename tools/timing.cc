#include "tools/timing.h"

#include <chrono>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "common/engine/generate.h"

namespace kvwire::tools {

absl::StatusOr<TimedGeneration> TimeGreedyGeneration(LlamaModel& model,
                                                     absl::Span<const int32_t> prompt,
                                                     int decode_steps,
                                                     const CompressionConfig& compression,
                                                     const DecodeAttentionConfig& attention) {
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  if (decode_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode steps must be >= 0, got ", decode_steps));
  }
  const int context = model.config().context_limit();
  if (static_cast<int64_t>(prompt.size()) + decode_steps + 1 > context) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ", prompt.size(), "-token prompt and ", decode_steps,
                     " decode steps do not fit in the model's context of ", context,
                     " (prompt + steps + 1 must not exceed it)"));
  }
  GenerationRequest req;
  req.prompt_ids.assign(prompt.begin(), prompt.end());
  req.max_tokens = decode_steps + 1;  // the prefill's token, then one per step
  req.sampling.temperature = 0;       // greedy; no stop ids, so end-of-sequence is ignored
  req.compression = compression;
  req.attention = attention;
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(GenerationResult r, Generate(model, req));
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  TimedGeneration out;
  // Generate times its decode loop itself; everything before it is the prefill.
  out.decode_seconds = r.decode_seconds;
  out.prefill_seconds = total - r.decode_seconds;
  out.ids = std::move(r.ids);
  out.prefill_copies = r.prefill_copies;
  out.decode_copies = r.decode_copies;
  return out;
}

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view list, int vocab_size) {
  std::vector<int32_t> ids;
  if (list.empty()) return absl::InvalidArgumentError("no token ids given");
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id) || id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token id '", part, "' (position ", ids.size(),
                                                     ") is not an integer in [0, ", vocab_size,
                                                     ")"));
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace kvwire::tools
