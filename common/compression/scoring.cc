#include "common/compression/scoring.h"

#include <cstdint>

#include "common/base/status.h"

namespace kvwire {

const std::vector<absl::string_view>& PoolNames() {
  static const auto* const kNames = new std::vector<absl::string_view>{"max", "avg"};
  return *kNames;
}

const std::vector<absl::string_view>& GqaNames() {
  static const auto* const kNames =
      new std::vector<absl::string_view>{"per_query_head", "sum", "mean", "max"};
  return *kNames;
}

absl::Status GroupVotes(const LayerInput& in, const SelectionOps& ops, GqaMode mode) {
  kernels::WindowVotesParams p;
  p.scores = in.scores->data;
  p.n_heads = in.n_heads;
  p.window = in.scores->window;
  p.len = in.len;
  p.prefix = in.prefix;
  p.group = mode == GqaMode::kPerQueryHead ? 1 : in.n_heads / in.n_kv_heads;
  p.reduce = mode == GqaMode::kMax    ? kernels::VoteReduce::kMax
             : mode == GqaMode::kMean ? kernels::VoteReduce::kMean
                                      : kernels::VoteReduce::kSum;
  p.votes = ops.votes;
  return ops.backend->WindowVotes(p);
}

absl::StatusOr<const int32_t*> SelectByPooledVotes(const LayerInput& in, const SelectionOps& ops,
                                                   GqaMode mode, int kernel, PoolKind pool) {
  RETURN_IF_ERROR(GroupVotes(in, ops, mode));
  RETURN_IF_ERROR(
      ops.backend->Pool1d({ops.votes, ops.pooled, in.cache_heads, in.prefix, kernel, pool}));
  std::vector<kernels::TopKSegment> rows(in.cache_heads);
  for (int c = 0; c < in.cache_heads; ++c) {
    kernels::TopKSegment& s = rows[c];
    s.score = ops.pooled + int64_t{c} * in.prefix;
    s.tie = ops.votes + int64_t{c} * in.prefix;
    s.n = in.prefix;
    s.k = in.prefix_budget;
    s.append = in.window;
    s.out = ops.kept + int64_t{c} * (in.prefix_budget + in.window);
  }
  RETURN_IF_ERROR(ops.backend->TopK({rows.data(), in.cache_heads, /*ascending=*/true}));
  return ops.kept;
}

}  // namespace kvwire
