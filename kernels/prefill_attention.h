// The CPU backend's causal prefill attention (kernels/backend.h, PrefillAttentionParams):
// flash-style tiles with an online softmax (Dao et al., FlashAttention, Algorithm 1), the
// query heads of a GQA group sharing each key tile.
//
// A task is (kv head, tile of kQueryTile query rows). Each key tile of kKeyTile rows is
// transposed once per task (8×8 register transposes), so a query row's kKeyTile scores are
// kKeyTile/8 vector accumulators fed by one broadcast of each query element: no horizontal
// sums, whatever the head dimension (the per-key dot products this replaces spent most of
// their time reducing 8-lane sums, and the 260K-parameter model's head_dim is 8). The
// weighted values accumulate in registers across the tile, several independent sets for
// short heads so the FMA latency does not serialise them. Each value tile is copied to a
// contiguous buffer first (a KV head's rows in place, a K/V row apart, fall into a few L1 sets
// and evict each other), and with AVX-512 the query heads of a group go four (or two) at a
// time in 512-bit vectors, each key-tile and value-row load feeding all of them. Observation-window
// rows keep their raw scores in the caller's window_scores as the tiles pass and turn them into
// probabilities with the row's final max and sum: the same scores the output was made from.
#pragma once

#include "kernels/backend.h"
#include "kernels/thread_pool.h"

namespace kvwire::kernels {

// `min_work_per_task`: multiply-adds below which tasks are batched into one chunk.
void CpuPrefillAttention(const PrefillAttentionParams& p, ThreadPool& pool,
                         int64_t min_work_per_task);

}  // namespace kvwire::kernels
