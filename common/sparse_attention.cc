#include "common/sparse_attention.h"

#include "absl/strings/str_cat.h"

namespace kvwire {

absl::string_view AttentionModeName(AttentionMode m) {
  switch (m) {
    case AttentionMode::kDense:
      return "dense";
    case AttentionMode::kHybrid:
      return "hybrid";
    case AttentionMode::kQuest:
      return "quest";
    case AttentionMode::kExactTopK:
      return "exact_topk";
  }
  return "?";
}

absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name) {
  for (AttentionMode m : {AttentionMode::kDense, AttentionMode::kHybrid, AttentionMode::kQuest,
                          AttentionMode::kExactTopK}) {
    if (name == AttentionModeName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown decode attention mode '", name, "'; expected dense, hybrid, quest or exact_topk"));
}

absl::Status DecodeAttentionConfig::Validate() const {
  if (token_budget < 0 || top_k < 0 || top_r < 0 || page_size < 0) {
    return absl::InvalidArgumentError("attention: token_budget, top_k, top_r and page_size must be >= 0");
  }
  if (mode != AttentionMode::kDense) {
    return absl::UnimplementedError(absl::StrCat("decode attention mode ", AttentionModeName(mode),
                                                 " is not available in this build"));
  }
  return absl::OkStatus();
}

std::string DecodeAttentionConfig::Describe() const { return std::string(AttentionModeName(mode)); }

absl::StatusOr<std::unique_ptr<DecodeSelector>> MakeDecodeSelector(const DecodeAttentionConfig& config,
                                                                   const ModelConfig& model) {
  if (config.mode == AttentionMode::kDense) return std::unique_ptr<DecodeSelector>();
  return absl::UnimplementedError("sparse decode attention is not available in this build");
}

}  // namespace kvwire
