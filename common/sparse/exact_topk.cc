// `exact_topk`: exact softmax scores per query head, summed over the group, and the exact
// top-k tokens per KV head. An oracle (it reads every key to choose), the ceiling sparse
// methods are measured against, not a method to deploy.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/sparse/attention.h"

namespace kvwire {
namespace {

void ExactSelect(const HeadQuery& hq) {
  const LayerCache& lc = *hq.cache;
  const int d = lc.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> total(lc.len, 0.f), s(lc.len), row(d);
  for (int g = 0; g < hq.group; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < lc.len; ++t) {
      ToFloat(lc.dtype, lc.k_row(hq.head, t), row.data(), d);
      float dot = 0.f;
      for (int i = 0; i < d; ++i) dot += hq.q[g * d + i] * row[i];
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    double z = 0;
    for (int t = 0; t < lc.len; ++t) z += s[t] = std::exp(s[t] - mx);
    for (int t = 0; t < lc.len; ++t) total[t] += static_cast<float>(s[t] / z);
  }
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
