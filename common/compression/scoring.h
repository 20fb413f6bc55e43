// Scoring steps the observation-window policies share: the window's votes per query head
// (SnapKV Listing 1, l.11), their combination over a GQA group, and 1-D pooling (l.13).
// Each policy composes them in its own file; the order in which scored positions are
// ranked is common/base/ranking.h's.
#pragma once

#include <vector>

#include "absl/strings/string_view.h"
#include "common/compression/policy.h"

namespace kvwire {

enum class PoolKind { kMax, kAvg };
// Names in enum order: "max", "avg".
const std::vector<absl::string_view>& PoolNames();

// How the votes of a GQA group's query heads become selections.
enum class GqaMode {
  kPerQueryHead,  // the original SnapKV code: each query head selects; n_rep times the cache
  kSum,           // one selection per KV head from the group's summed votes (default)
  kMean,
  kMax,
};
// Names in enum order: "per_query_head", "sum", "mean", "max".
const std::vector<absl::string_view>& GqaNames();

// vote[h][j] = Σ over the window's queries of the attention on prefix key j, for j in
// [0, prefix) (the window's own columns are not voted on: the window is kept whole).
std::vector<std::vector<float>> HeadVotes(const WindowScores& scores, int prefix);

// One row per cache head: the query heads' rows as they are (per query head), or the
// group's sum, mean or max per KV head (RocketKV Algorithm 1 sums after the softmax and
// before pooling).
std::vector<std::vector<float>> GroupVotes(std::vector<std::vector<float>> votes, GqaMode mode,
                                           int n_kv_heads);

// pool1d(x, kernel, padding = kernel / 2, stride 1). Max pooling pads with -inf; average
// pooling counts the padding (divides by the kernel), as PyTorch's avg_pool1d does by
// default. A kernel of 1 returns x.
std::vector<float> Pool1d(const std::vector<float>& x, int kernel, PoolKind kind);

// Means of consecutive runs of `size` scores (the last run may be shorter): ChunkKV's
// chunk scores and HBW-KV's block scores.
std::vector<float> RunMeans(const std::vector<float>& x, int size);

}  // namespace kvwire
