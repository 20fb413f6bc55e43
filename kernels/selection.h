// The selection compute of kvwire as backend ops: what prompt compression (SnapKV and its
// family, ChunkKV, HBW-KV) and sparse decode (RocketKV's hybrid attention, Quest, exact
// top-k) compute between the model's ops, and token sampling, so that a device backend keeps
// all of it in device memory: a compressing prefill ships only the kept rows, a sparse decode
// step copies nothing per layer, and a step's logits never leave the device.
//
// The policies compose these in the manner of kvpress's scorer presses: a policy produces
// scores (WindowVotes → Pool1d, or RunMeans), and the shared code ranks them (TopK) and
// gathers the kept rows (GatherKv). docs/algorithms.md specifies each policy; the ranking
// order everywhere is common/base/ranking.h's: the higher score, then the higher tie score,
// then the lower index, a NaN below every number.
//
// Batched ops take a host array of segments (one per row, cache head or sequence), as
// DecodeAttentionParams does; the pointers inside are backend memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/base/dtype.h"
#include "common/base/kv_format.h"
#include "kernels/sampling.h"

namespace kvwire::kernels {

// Where a cache's K (or V) rows are, relative to a base pointer, in elements of the cache
// dtype: token t of cache head c. Either one region per layer (pages null: a host cache),
//   c·head_stride + t·head_dim,
// or pages of `page_tokens` tokens from a pool, FlashInfer's paged layout (HND: a page holds
// heads_per_page heads × page_tokens rows, page_stride elements apart), a layer's page table
// listing for each block of page_tokens tokens the n_heads / heads_per_page pages of its heads:
//   pages[(t / page_tokens)·(n_heads / heads_per_page) + c / heads_per_page]·page_stride
//     + (c % heads_per_page)·page_tokens·head_dim + (t % page_tokens)·head_dim.
// The page table is a host array: a device backend uploads it with the op (as vLLM uploads a
// step's block tables), so the pages of a cache can change between ops at no cost.
struct KvLayout {
  const int32_t* pages = nullptr;
  int page_tokens = 0, heads_per_page = 0, n_heads = 0;
  int64_t page_stride = 0;
  int64_t head_stride = 0;  // one region: elements between heads

  KVWIRE_HOST_DEVICE int64_t Row(int c, int t, int head_dim) const {
    if (pages == nullptr) return c * head_stride + int64_t{t} * head_dim;
    const int per_block = n_heads / heads_per_page;
    const int64_t page = pages[(t / page_tokens) * per_block + c / heads_per_page];
    return page * page_stride +
           (int64_t{c % heads_per_page} * page_tokens + t % page_tokens) * head_dim;
  }
  // Rows of head c from token t on that are contiguous: to the end of t's page (all of them
  // in one region).
  KVWIRE_HOST_DEVICE int RunFrom(int t, int len) const {
    if (pages == nullptr) return len - t;
    const int end = (t / page_tokens + 1) * page_tokens;
    return (end < len ? end : len) - t;
  }
  // Entries of the page table a cache of `tokens` tokens per head uses.
  KVWIRE_HOST_DEVICE int64_t TableEntries(int tokens) const {
    return pages == nullptr
               ? 0
               : int64_t{(tokens + page_tokens - 1) / page_tokens} * (n_heads / heads_per_page);
  }
  // One region whose heads are head_stride apart.
  static KvLayout Region(int64_t head_stride) {
    KvLayout l;
    l.head_stride = head_stride;
    return l;
  }
};

// A cache layer whose rows are coded as the wire ships them (common/base/kv_format.h) rather
// than held in the cache dtype: key code rows at the sequence's KvLayout and value rows at
// v_layout (both in bytes: Row(c, t, row bytes)), each key group's per-channel parameters and
// (fp8) each value group's scale beside them, and the tokens appended since the last whole
// group in the cache dtype (KIVI's residual), until AppendKv fills a group and codes it.
struct KvCoding {
  KvFormat format = KvFormat::kAuto;  // kAuto: rows in the cache dtype; nothing below applies
  int kept = 0;                       // the prompt's tokens per head, which fix the groups
  int max_groups = 0;                 // groups per head in k_params and v_scales
  int resid_tokens = 0;               // residual rows per head
  uint8_t* k_params = nullptr;        // head c's group g at (c·max_groups + g)·KvKeyGroupBytes
  uint8_t* v_scales = nullptr;        // fp8: head c's group g at c·max_groups + g
  void* k_resid = nullptr;            // head c's slot i at (c·resid_tokens + i)·head_dim elements
  void* v_resid = nullptr;
  KvLayout v_layout;

  KVWIRE_HOST_DEVICE bool coded() const {
    return format == KvFormat::kFP8 || format == KvFormat::kInt8 || format == KvFormat::kInt4;
  }
  // Tokens [ResidBegin(len), len) of a head are in the residual, at slot t − ResidBegin(len).
  KVWIRE_HOST_DEVICE int ResidBegin(int len) const {
    return len <= kept ? len : kept + (len - kept) / kKeyGroupTokens * kKeyGroupTokens;
  }
  // Rows [0, PagedRows(len)) of a head are in its layout's rows (and pages): a coded cache
  // holds only whole groups there, so a page table sized for `len` would run past its end.
  KVWIRE_HOST_DEVICE int PagedRows(int len) const { return coded() ? ResidBegin(len) : len; }
};

// ------------------------------------------------------------------ prefill scoring

// How the votes of a group of query heads combine into one row.
enum class VoteReduce : int { kSum, kMean, kMax };

// SnapKV's votes (Listing 1, l.11) reduced over groups of query heads:
//   votes[r, j] = reduce over x < group of Σ_{i < window} scores[r·group + x, i, j], j < prefix,
// each head's sum taken over i in order in float32, then the group's sum (or mean: that sum
// over group; or max, std::max from −∞) over x in order. group 1: one row per query head;
// n_heads / n_kv_heads: one per KV head (RocketKV Algorithm 1 sums after the softmax);
// n_heads: one row for the layer (ChunkKV's per-layer index set).
struct WindowVotesParams {
  const float* scores = nullptr;  // [n_heads, window, len] (PrefillAttentionParams)
  int n_heads = 0, window = 0, len = 0;
  int prefix = 0;  // the columns voted on, [0, prefix); the window's own are not
  int group = 1;   // query heads per output row; divides n_heads
  VoteReduce reduce = VoteReduce::kSum;
  float* votes = nullptr;  // [n_heads / group, prefix]
};

enum class PoolKind : int { kMax, kAvg };

// pool1d over each row (SnapKV Listing 1, l.13): stride 1, padding kernel / 2, max pooling
// over the window clipped to the row, average pooling summing it in order and dividing by the
// kernel (padding counts, as PyTorch's avg_pool1d). kernel 1 copies. y must not alias x.
struct Pool1dParams {
  const float* x = nullptr;  // [rows, n]
  float* y = nullptr;        // [rows, n]
  int rows = 0, n = 0, kernel = 1;
  PoolKind kind = PoolKind::kMax;
};

// Means of runs of `run` consecutive values of each row (the last run may be shorter), summed
// in order: ChunkKV's chunk scores and HBW-KV's block scores.
struct RunMeansParams {
  const float* x = nullptr;  // [rows, n]
  float* y = nullptr;        // [rows, ceil(n / run)]
  int rows = 0, n = 0, run = 1;
};

// ------------------------------------------------------------------ ranking

// The k best of n items in the project's order. Item j scores score[j / run]: runs of `run`
// consecutive items share one score (a page of slots, a chunk of tokens), so the best items are
// whole runs best first, the last one cut to its lowest items (TakePages, ChunkKV's chunks).
// With a tie array (run 1 only) equal scores are ordered by tie[j] (SnapKV: pooled votes, then
// the raw votes). Writes k ≤ n distinct indices, best first or (ascending) in ascending order,
// then `append` more: n, n + 1, ... (the observation window, kept whatever the scores).
struct TopKSegment {
  const float* score = nullptr;  // [ceil(n / run)]
  const float* tie = nullptr;    // [n], or null
  int n = 0, run = 1, k = 0;
  int append = 0;
  int32_t* out = nullptr;  // [k + append]
};
struct TopKParams {
  const TopKSegment* segs = nullptr;  // host array [count]
  int count = 0;
  bool ascending = false;
};

// HBW-KV's hierarchical block selection (§3.2.3; docs/algorithms.md §6.2-6.3) over each row's
// block scores: ⌊prefix_budget / block⌋ whole blocks shared equally by the rounds, each round
// spreading its share over its groups, each group taking its best blocks no earlier round took,
// then the best remaining blocks fill the budget, the last cut to fit. Writes the kept prefix
// positions of each row in ascending order, then `append` more: prefix, prefix + 1, ...
inline constexpr int kMaxHbwRounds = 64;
struct HbwSelectParams {
  const float* block_scores = nullptr;  // [rows, ceil(prefix / block)]
  int rows = 0, prefix = 0, block = 1, prefix_budget = 0;
  int append = 0;
  int rounds[kMaxHbwRounds] = {};  // the group count of each round
  int n_rounds = 0;
  int32_t* out = nullptr;  // [rows, prefix_budget + append]
};

// The kept rows of one layer into a contiguous send buffer: cache head c, slot t takes token
// kept[c, t] of KV head c / (n_cache_heads / n_kv_heads), converted to `dtype` (to nearest
// even).
struct GatherKvParams {
  const float* k = nullptr;  // token t, KV head g at k + t·kv_stride + g·head_dim
  const float* v = nullptr;
  int64_t kv_stride = 0;
  const int32_t* kept = nullptr;  // [n_cache_heads, count], each in [0, len)
  int len = 0;                    // tokens k and v hold
  int n_cache_heads = 0, n_kv_heads = 0, head_dim = 0, count = 0;
  DType dtype = DType::kF32;
  void* k_out = nullptr;  // [n_cache_heads, count, head_dim] in dtype
  void* v_out = nullptr;
};

// ------------------------------------------------------------------ page summaries

// Where page summaries live (RocketKV Algorithm 2 lines 1-2): per cache head one block of
// sets·head_dim·max_pages elements in the cache dtype, sets = 2 (min, max) or 1 for pages of
// one token (min = max = the key). Within a head's block, tiles of tile_pages pages follow one
// another; within a tile, each dimension's min row then its max row over the tile's pages
// (the last tile: up to max_pages). Hybrid attention reads whole rows (one tile holds every
// page); Quest reads every row, tile by tile.
struct SummaryLayout {
  int head_dim = 0;
  int page = 1;
  int tile_pages = 1 << 30;
  int max_pages = 0;  // pages per head the block holds: ceil(capacity / page)
  DType dtype = DType::kF32;

  KVWIRE_HOST_DEVICE int sets() const { return page == 1 ? 1 : 2; }
  KVWIRE_HOST_DEVICE int pages(int len) const { return (len + page - 1) / page; }
  // Elements of one head's block.
  KVWIRE_HOST_DEVICE int64_t head_elems() const { return int64_t{sets()} * head_dim * max_pages; }
  // Element offset, within a head's block, of dimension `dim`'s min (or max) row of tile
  // `tile`: that row holds the tile's pages contiguously.
  KVWIRE_HOST_DEVICE int64_t RowOffset(bool max, int dim, int tile) const {
    const int64_t first = int64_t{tile_pages} * tile;
    const int64_t width =
        max_pages - first < tile_pages ? max_pages - first : static_cast<int64_t>(tile_pages);
    const int set = sets() == 2 && max ? 1 : 0;
    return first * sets() * head_dim + (int64_t{dim} * sets() + set) * width;
  }
  // Element offset of page p's min (or max) of dimension `dim`.
  KVWIRE_HOST_DEVICE int64_t Offset(bool max, int dim, int p) const {
    return RowOffset(max, dim, p / tile_pages) + p % tile_pages;
  }
};

// Brings each cache head's summaries up to date after tokens were appended: the pages holding
// tokens [first, len) are recomputed from their slots (min and max of each dimension, exact in
// the cache dtype).
struct SummaryUpdateSegment {
  const void* k = nullptr;  // the keys: cache head c, token t at kv.Row(c, t) elements from k
  KvLayout kv;
  KvCoding coding;  // a coded cache's (then each key dequantised, and its min and max rounded)
  int n_heads = 0;
  int first = 0, len = 0;
  void* summaries = nullptr;  // head c's block at c·layout.head_elems() elements
  SummaryLayout layout;
};
struct UpdateSummariesParams {
  const SummaryUpdateSegment* segs = nullptr;  // host array [count]
  int count = 0;
};

// ------------------------------------------------------------------ decode page scores

// What one cache head's sparse selection ranks (TopK with run = page: whole pages best first):
//   kHybrid  RocketKV Algorithm 2 lines 3-6: the top_r head dimensions by Σ_g |q_g| over the
//            group; per query head, page logits from the summaries (K_max where Σ_g q ≥ 0,
//            else K_min) over those dimensions, SparQ-scaled by 1/sqrt(d·‖q_I‖₁/‖q‖₁); a
//            softmax per head over slots (each slot carrying its page's logit), summed over
//            the group. score has pages(len) entries.
//   kQuest   Quest's upper bound Σ_i Σ_g q_g,i · (q_g,i ≥ 0 ? K_max,i : K_min,i) per page.
//   kExact   exact softmax scores per query head over the len keys, summed over the group
//            (the exact top-k oracle); score has len entries.
enum class PageScoreKind : int { kHybrid, kQuest, kExact };
struct PageScoreSegment {
  PageScoreKind kind = PageScoreKind::kHybrid;
  const float* q = nullptr;  // the group's query heads [group, head_dim], after RoPE
  int group = 1;
  int len = 0;                      // tokens in the cache head
  const void* summaries = nullptr;  // hybrid, quest: this head's block
  SummaryLayout layout;             // hybrid, quest
  int top_r = 0;                    // hybrid
  const void* k = nullptr;          // exact: the keys, cache head c's token t at kv.Row(c, t)
  KvLayout kv;                      // exact
  KvCoding coding;                  // exact: a coded cache's
  int head = 0;                     // exact: the cache head
  float scale = 1.f;                // exact: the attention scale
  float* score = nullptr;           // [pages(len)], or [len] for kExact
};
struct PageScoresParams {
  const PageScoreSegment* segs = nullptr;  // host array [count]
  int count = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;  // of the summaries and keys
};

// ------------------------------------------------------------------ sampling

// One row of SampleParams: the request's sampling and the uniform number its seeded generator
// drew for this token (kernels/sampling.h).
struct SampleRow {
  SamplingParams params;
  double uniform = 0;
};
// Samples one token from each row of logits as kernels::Sample does: candidates ordered by
// (probability, then the lower id), truncated by top-k then top-p, the first whose cumulative
// probability exceeds uniform · mass; greedy (temperature 0) is the argmax with the lowest id
// on ties. Each row's token and its log-probability (temperature 1, no truncation) go to out.
struct SampleParams {
  const float* logits = nullptr;  // [batch, vocab], row stride `stride` floats (0: vocab)
  int64_t stride = 0;
  int batch = 0, vocab = 0;
  const SampleRow* rows = nullptr;  // host array [batch]
  SampledToken* out = nullptr;      // backend memory [batch]
};

}  // namespace kvwire::kernels
