// RocketKV (Behnam et al., "RocketKV: Accelerating Long-Context LLM Inference via Two-Stage
// KV Cache Compression", 2025): stage 2's hybrid sparse attention (the `hybrid` decode
// attention mode, Section 3.4 / Algorithm 2), and the two-stage method (`rocketkv`
// policy, Section 3.5) that splits one per-step token budget between stage 1's prompt
// compression (SnapKV++, common/compression/snapkv_pp.cc) and stage 2.
#pragma once

#include "absl/status/statusor.h"
#include "common/compression/compression.h"
#include "common/sparse/attention.h"

namespace kvwire {

// RocketKV's two stages from one token budget t for a prompt of `prompt_len` tokens that
// will generate up to `max_new` (the authors' get_params_for_token_budget, or the paper's
// √c split with budget_split=sqrt): S = prompt + max_new, c = S / t, capacity = S / c^α
// with α = min(0.2 + 0.06·log2 c, 0.8) (or 1/2), stage 1 keeps capacity − max_new prompt
// tokens (SnapKV++), stage 2 reads t per step (k = t/2 tokens, pages and r from the stage-2
// ratio capacity / t).
struct TwoStage {
  CompressionConfig stage1;
  DecodeAttentionConfig stage2;
};
absl::StatusOr<TwoStage> ResolveRocketKV(int token_budget, int prompt_len, int max_new,
                                         int head_dim, const CompressionConfig& base);

// Turns a two-stage compression (rocketkv: one token budget) into its two stages in place;
// any other policy is left as it is. Needs the prompt length and max_tokens (the α rule
// sizes stage 1 by the whole sequence). Sparse decode attention then attends densely in the
// layers the compression kept whole (skip_layers), as RocketKV's reference code does.
absl::Status ResolveTwoStage(CompressionConfig* compression, DecodeAttentionConfig* attention,
                             int prompt_len, int max_new, int head_dim);

}  // namespace kvwire
