// `exact_topk`: exact softmax scores per query head, summed over the group, and the exact
// top-k tokens per KV head. An oracle (it reads every key to choose), the ceiling sparse
// methods are measured against, not a method to deploy.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/sparse/attention.h"
#include "kernels/cpu/selection.h"

namespace kvwire {
namespace {

void ExactSelect(const HeadQuery& hq) {
  const LayerCache& lc = *hq.cache;
  thread_local std::vector<float> total;
  total.resize(lc.len);
  kernels::PageScoreSegment s;
  s.kind = kernels::PageScoreKind::kExact;
  s.q = hq.q;
  s.group = hq.group;
  s.len = lc.len;
  s.k = lc.k;
  s.kv = lc.layout;
  s.coding = lc.coding;
  s.head = hq.head;
  s.scale = 1.f / std::sqrt(static_cast<float>(lc.head_dim));
  s.score = total.data();
  kernels::cpu::HeadPageScores(s, lc.head_dim, lc.dtype);
  TakePages(total, 1, lc.len, hq.params->top_k, hq.out);
}

absl::StatusOr<SparseParams> ResolveExact(const DecodeAttentionConfig& c, int, int head_dim) {
  SparseParams p;
  p.mode = AttentionMode::kExactTopK;
  p.top_r = head_dim;
  p.top_k = c.token_budget;
  return p;
}

// Every key to score, then the k chosen values.
int64_t ExactBytes(const SparseParams& p, int len, int64_t row, int64_t) {
  return row * len + row * p.top_k;
}

const AttentionModeInfo& Info() {
  static const AttentionModeInfo* const info = new AttentionModeInfo{AttentionMode::kExactTopK,
                                                                     "exact_topk",
                                                                     "oracle: exact top-k tokens",
                                                                     {"token_budget", "top_k"},
                                                                     /*summaries=*/false,
                                                                     &ResolveExact,
                                                                     &ExactBytes,
                                                                     &ExactSelect};
  return *info;
}

}  // namespace

const AttentionModeInfo& ExactTopKModeInfo() { return Info(); }

}  // namespace kvwire
