// Decode-side attention modes (chosen per request): which cached tokens each KV head
// attends to at each step, as a DecodeSelector the engine consults. Each mode lives in
// one file of this folder and is listed by the registry below:
//
//   dense       exact attention over the whole (compressed) cache
//   hybrid      rocketkv.cc: RocketKV stage 2 (Section 3.4, Algorithm 2), hybrid sparse
//               attention over page min/max summaries; with the two-stage budget split
//               of the `rocketkv` policy (§3.5)
//   quest       quest.cc: page-level top-k by Quest's upper bound
//   exact_topk  exact_topk.cc: exact scores, exact top-k tokens (an oracle, not a method)
//
// Page summaries (page_summaries.h) are shared by hybrid and quest. docs/algorithms.md
// §3-4 specifies the modes with citations.
//
// Budgets (RocketKV Section 3.5): a token budget t counts the K/V one step reads per KV
// head, page summaries included (one token-equivalent = 2·d elements), so modes compare
// at equal memory traffic.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/flags.h"
#include "common/model/kv_cache.h"
#include "common/model/llama_model.h"
#include "common/model/model_config.h"
#include "common/sparse/page_summaries.h"

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
  int page_size = 0;  // hybrid, quest: tokens per page summary (overrides)
  // The first layers attend densely: the layers the prompt's compression kept whole
  // (skip_layers), as RocketKV's reference does. Set from the compression, not by a request.
  int dense_layers = 0;

  // InvalidArgument for a value out of range, or a parameter the mode does not take.
  absl::Status Validate() const;
  std::string Describe() const;
};

// The concrete parameters of one sequence's selector.
struct SparseParams {
  AttentionMode mode = AttentionMode::kDense;
  int top_k = 0, top_r = 0, page_size = 1;
};

// What a mode's selection sees for one KV head and writes: top_k cache slots. The model runs
// the selections of all heads of all sequences at once on its threads, so a mode's select
// writes nothing but `out` (and scratch of its own thread), and reads only its head's
// summaries, brought up to date for it.
struct HeadQuery {
  int layer = 0, head = 0;
  const float* q = nullptr;  // the group's query heads [group, head_dim]
  int group = 0;
  const LayerCache* cache = nullptr;
  PageSummaries* summaries = nullptr;  // brought up to date; null for modes without
  const SparseParams* params = nullptr;
  int32_t* out = nullptr;  // params->top_k slots
};

// One mode: its name, paper, parameters, and functions (defined in the mode's file).
struct AttentionModeInfo {
  AttentionMode mode;
  const char* name;
  const char* paper;
  std::vector<const char*> params;  // which of token_budget, top_k, top_r, page_size it takes
  bool summaries;                   // keeps page summaries
  // k, r and P for a cache that holds up to `capacity` tokens per head.
  absl::StatusOr<SparseParams> (*resolve)(const DecodeAttentionConfig& config, int capacity,
                                          int head_dim);
  // K/V bytes one step reads per KV head, auxiliary reads included (k < len).
  int64_t (*bytes_read)(const SparseParams& p, int len, int64_t row_bytes, int64_t elem_bytes);
  void (*select)(const HeadQuery& query);
  // Adjusts the parameters after explicit overrides (null: nothing to adjust).
  void (*finish)(SparseParams* params) = nullptr;
  // How its page summaries are laid out for its reads (page_summaries.h): whole rows, or
  // tiles of this many pages.
  int summary_tile_pages = PageSummaries::kRows;
};

// The registry, in the order the docs list modes.
const std::vector<const AttentionModeInfo*>& AttentionModes();
const AttentionModeInfo& ModeInfo(AttentionMode mode);

// Derives k, r and P for a cache that holds up to `capacity` tokens per head
// (docs/algorithms.md §3.4 for hybrid, §4 for quest).
absl::StatusOr<SparseParams> ResolveSparseParams(const DecodeAttentionConfig& config, int capacity,
                                                 int head_dim);

// Per-step K/V bytes one layer reads per KV head under these parameters, auxiliary
// (page summary) reads included, for a cache of `len` tokens in `dtype`.
int64_t BytesReadPerStep(const SparseParams& p, int len, int head_dim, DType dtype);
// The same for a layer's cache as it is kept, at its len. Over a coded cache: dense attention
// reads it whole (LayerCache::HeadBytes); a sparse mode its chosen rows' codes (the residual's
// rows in dtype), the parameters and fp8 value scale of each key group they fall in, and its
// reads beside the rows (page summaries, which stay in dtype; the exact oracle's every key).
// Where the rows are not known it bounds from above: the residual's rows all chosen, min(k,
// groups) groups touched (a top-k of 512 over 16K tokens falls in every one of its 128 groups).
int64_t BytesReadPerStep(const SparseParams& p, const LayerCache& layer);

// Bytes of pool memory MakeDecodeSelector will take for this sequence (its page
// summaries; 0 for dense, exact top-k and any mode that keeps none).
absl::StatusOr<size_t> DecodeSelectorBytes(const DecodeAttentionConfig& config,
                                           const ModelConfig& model, const KvCacheShape& cache);

// The selector of one sequence, or null for dense attention. Page summaries take their
// memory from `allocator` (the decode node's KV pool).
absl::StatusOr<std::unique_ptr<DecodeSelector>> MakeDecodeSelector(
    const DecodeAttentionConfig& config, const ModelConfig& model, const KvCacheShape& cache,
    KvAllocator& allocator);

// Takes whole pages best first (common/base/ranking.h) until k slots are collected,
// cutting the last page to its lowest slots: all slots of a page share its score, so
// top-k tokens are whole pages plus part of one (docs §3.3). Page 1 gives token top-k.
// The pages are found by partial selection (BestFirstPrefix), not a sort of all of them.
void TakePages(const std::vector<float>& score, int page, int len, int k, int32_t* out);

// --attention, --attention-budget, --attention-k, --attention-r, --attention-page.
void DefineAttentionFlags(Flags& flags);
absl::StatusOr<DecodeAttentionConfig> AttentionFromFlags(const Flags& flags);

}  // namespace kvwire
