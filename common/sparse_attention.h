// Decode-side attention modes (chosen per request), as DecodeSelectors the engine
// consults each step: which cached tokens each KV head attends to.
//
//   dense       exact attention over the whole (compressed) cache
//   hybrid      RocketKV stage 2 (Section 3.4, Algorithm 2): page min/max summaries,
//               top-r head dimensions, approximate scores, exact attention on top-k tokens
//   quest       page-level top-k from full-dimension min/max bounds (the comparison point)
//   exact_topk  exact scores, exact top-k: an oracle for evaluation only
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/llama_model.h"
#include "common/model_config.h"

namespace kvwire {

enum class AttentionMode { kDense, kHybrid, kQuest, kExactTopK };

absl::string_view AttentionModeName(AttentionMode m);
absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name);

struct DecodeAttentionConfig {
  AttentionMode mode = AttentionMode::kDense;
  // Tokens of K/V one step may read per KV head, auxiliary reads (page summaries)
  // included, as RocketKV Section 3.5 counts them. 0: from top_k / top_r / page_size.
  int token_budget = 0;
  int top_k = 0;      // tokens attended per KV head (0: from the budget)
  int top_r = 0;      // head dimensions of the approximation (hybrid; 0: from the budget)
  int page_size = 0;  // tokens per page summary (0: from the budget)

  absl::Status Validate() const;
  std::string Describe() const;
};

// The selector of one sequence, or null for dense attention.
absl::StatusOr<std::unique_ptr<DecodeSelector>> MakeDecodeSelector(const DecodeAttentionConfig& config,
                                                                   const ModelConfig& model);

}  // namespace kvwire
