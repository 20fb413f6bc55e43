// Decode-side attention modes (chosen per request), as DecodeSelectors the engine
// consults each step: which cached tokens each KV head attends to. docs/algorithms.md §3-4
// specifies them, with citations.
//
//   dense       exact attention over the whole (compressed) cache
//   hybrid      RocketKV stage 2 (Section 3.4, Algorithm 2): element-wise min/max summaries
//               of pages of P tokens; each step, per KV head, the top-r head dimensions by
//               Σ|q| over the group, K_max or K_min per dimension by the sign of Σq,
//               SparQ-scaled approximate scores, exact attention over the top-k tokens
//   quest       page-level top-k by the full-dimension upper bound Σ max(q·K_max, q·K_min)
//               (Quest, as RocketKV compares against it: scores summed over the group)
//   exact_topk  exact scores, exact top-k tokens per KV head: an oracle, not a method
//
// Budgets (RocketKV Section 3.5): a token budget t counts the K/V one step reads per KV
// head, page summaries included (one token-equivalent = 2·d elements), so modes compare
// at equal memory traffic. The two-stage `rocketkv` policy splits one budget between the
// prompt compression of stage 1 (SnapKV++) and stage 2 by the authors' rule
// α = min(0.2 + 0.06·log2 c, 0.8) (docs/algorithms.md §3.4).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/compression/compression.h"
#include "common/model/kv_cache.h"
#include "common/model/llama_model.h"
#include "common/model/model_config.h"

namespace kvwire {

enum class AttentionMode { kDense, kHybrid, kQuest, kExactTopK };

absl::string_view AttentionModeName(AttentionMode m);
absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name);

struct DecodeAttentionConfig {
  AttentionMode mode = AttentionMode::kDense;
  // Per-step token budget per KV head, auxiliary reads included. 0: explicit parameters.
  int token_budget = 0;
  int top_k = 0;      // tokens attended per KV head (overrides the budget's)
  int top_r = 0;      // hybrid: head dimensions of the approximation (overrides)
  int page_size = 0;  // tokens per page summary (overrides)

  absl::Status Validate() const;
  std::string Describe() const;
};

// The concrete parameters of one sequence's selector.
struct SparseParams {
  AttentionMode mode = AttentionMode::kDense;
  int top_k = 0, top_r = 0, page_size = 1;
};

// Derives k, r and P for a cache that holds up to `capacity` tokens per head
// (docs/algorithms.md §3.4 for hybrid, §4 for quest).
absl::StatusOr<SparseParams> ResolveSparseParams(const DecodeAttentionConfig& config, int capacity,
                                                 int head_dim);

// Per-step K/V bytes one layer reads per KV head under these parameters, auxiliary
// (page summary) reads included, for a cache of `len` tokens in `dtype`.
int64_t BytesReadPerStep(const SparseParams& p, int len, int head_dim, DType dtype);

// RocketKV's two stages from one token budget t for a prompt of `prompt_len` tokens that
// will generate up to `max_new` (the authors' get_params_for_token_budget):
// S = prompt + max_new, c = S / t, α = min(0.2 + 0.06·log2 c, 0.8), capacity = S / c^α,
// stage 1 keeps capacity − max_new prompt tokens (SnapKV++), stage 2 reads t per step
// (k = t/2 tokens, pages and r from the stage-2 ratio capacity / t).
struct TwoStage {
  CompressionConfig stage1;
  DecodeAttentionConfig stage2;
};
absl::StatusOr<TwoStage> ResolveRocketKV(int token_budget, int prompt_len, int max_new,
                                         int head_dim, const CompressionConfig& base);

// Page min/max summaries of one sequence's cache (RocketKV Alg. 2 lines 1-2, docs §3.2):
// per layer and cache head, rows [2·d][max_pages] in the cache dtype (min rows first),
// transposed so that one head dimension over all pages is contiguous — the gather of
// step 2 reads r such rows. Pages are aligned to slot 0 of the compressed cache.
class PageSummaries {
 public:
  PageSummaries(const KvCacheShape& shape, int page, KvMemoryPtr memory);
  static size_t Bytes(const KvCacheShape& shape, int page);

  // Brings `layer` up to date with the cache (call after tokens were appended).
  void Update(int layer, const LayerCache& lc);
  int page() const { return page_; }
  int pages(int len) const { return (len + page_ - 1) / page_; }
  // Dimension `dim` of the min (or max) summary of every page: max_pages elements.
  uint8_t* Row(int layer, int head, bool max, int dim);
  float Value(int layer, int head, bool max, int dim, int page);

 private:
  KvCacheShape shape_;
  int page_;
  KvMemoryPtr memory_;
  std::vector<int> max_pages_;
  std::vector<size_t> offsets_;
  std::vector<int> built_;
};

// Turns a `rocketkv` compression (one token budget) into its two stages in place; any
// other policy is left as it is. Needs the prompt length and max_tokens (the α rule
// sizes stage 1 by the whole sequence).
absl::Status ResolveTwoStage(CompressionConfig* compression, DecodeAttentionConfig* attention,
                             int prompt_len, int max_new, int head_dim);

// Bytes of pool memory MakeDecodeSelector will take for this sequence (its page
// summaries; 0 for dense, exact top-k and any mode that keeps none).
absl::StatusOr<size_t> DecodeSelectorBytes(const DecodeAttentionConfig& config,
                                           const ModelConfig& model, const KvCacheShape& cache);

// The selector of one sequence, or null for dense attention. Page summaries take their
// memory from `allocator` (the decode node's KV pool).
absl::StatusOr<std::unique_ptr<DecodeSelector>> MakeDecodeSelector(const DecodeAttentionConfig& config,
                                                                   const ModelConfig& model,
                                                                   const KvCacheShape& cache,
                                                                   KvAllocator& allocator);

}  // namespace kvwire
