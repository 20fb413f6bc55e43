// Scoring steps the observation-window policies share, on the backend's selection ops
// (kernels/selection.h): the window's votes per query head (SnapKV Listing 1, l.11), their
// combination over a GQA group, 1-D pooling (l.13), and the top of the pooled votes with the
// window kept (l.15-19). Each policy composes them in its own file; the order in which scored
// positions are ranked is common/base/ranking.h's.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/compression/policy.h"
#include "kernels/selection.h"

namespace kvwire {

using PoolKind = kernels::PoolKind;
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

// The votes of the window over the prefix, one row per cache head (WindowVotes): the query
// heads' rows as they are (per query head), or the group's sum, mean or max per KV head
// (RocketKV Algorithm 1 sums after the softmax and before pooling). Into ops.votes.
absl::Status GroupVotes(const LayerInput& in, const SelectionOps& ops, GqaMode mode);

// SnapKV's selection (Listing 1, l.11-19): the group's votes, pooled with `kernel`, the
// prefix_budget best positions of each row by the pooled votes (a budget that cuts through a
// pooling plateau keeps the plateau's peaks: the raw votes break the tie, then the position),
// in ascending order, then the window. Returns ops.kept.
absl::StatusOr<const int32_t*> SelectByPooledVotes(const LayerInput& in, const SelectionOps& ops,
                                                   GqaMode mode, int kernel, PoolKind pool);

}  // namespace kvwire
