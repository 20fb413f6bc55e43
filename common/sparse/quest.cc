// `quest`: Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
// Inference", ICML 2024), as RocketKV compares against it: per page of P keys the upper
// bound Σ_i max(q_i·K_max,i, q_i·K_min,i) over every head dimension, summed over the
// group's query heads; the best pages are attended exactly, whole. Reading both summaries of
// a page costs one token-equivalent, so a budget t buys t/2 tokens and t/2 pages (P = 2n/t);
// k is then rounded down to whole pages, at least one (a budget smaller than a page reads
// one page: Quest cannot attend part of one).
#include <algorithm>
#include <cmath>

#include "common/sparse/attention.h"
#include "kernels/cpu/selection.h"

namespace kvwire {
namespace {

// Quest's bound per page (kernels/cpu/page_scores.cc, the same code the backend op runs), then
// the best pages whole.
void QuestSelect(const HeadQuery& hq) {
  const LayerCache& lc = *hq.cache;
  thread_local std::vector<float> bound;
  bound.resize(hq.summaries->pages(lc.len));
  kernels::PageScoreSegment s;
  s.kind = kernels::PageScoreKind::kQuest;
  s.q = hq.q;
  s.group = hq.group;
  s.len = lc.len;
  s.summaries = hq.summaries->HeadBlock(hq.layer, hq.head);
  s.layout = hq.summaries->Layout(hq.layer);
  s.score = bound.data();
  kernels::cpu::HeadPageScores(s, lc.head_dim, lc.dtype);
  TakePages(bound, hq.summaries->page(), lc.len, hq.params->top_k, hq.out);
}

absl::StatusOr<SparseParams> ResolveQuest(const DecodeAttentionConfig& c, int capacity,
                                          int head_dim) {
  SparseParams p;
  p.mode = AttentionMode::kQuest;
  const int t = c.token_budget;
  p.page_size = t > 0 ? std::max(1, static_cast<int>(std::ceil(2.0 * capacity / t))) : 16;
  p.top_r = head_dim;
  p.top_k = t > 0 ? std::max(1, t / 2) : 0;
  return p;
}

// Whole pages: k rounded down to a multiple of P, at least one page.
void WholePages(SparseParams* p) { p->top_k = std::max(1, p->top_k / p->page_size) * p->page_size; }

// k tokens, and both summaries of every page (one, for pages of one token).
int64_t QuestBytes(const SparseParams& p, int len, int64_t row, int64_t) {
  const int64_t pages = (len + p.page_size - 1) / p.page_size;
  return 2 * row * p.top_k + pages * (p.page_size == 1 ? 1 : 2) * row;
}

const AttentionModeInfo& Info() {
  static const AttentionModeInfo* const info =
      new AttentionModeInfo{AttentionMode::kQuest,
                            "quest",
                            "Quest (ICML 2024), as compared in RocketKV",
                            {"token_budget", "top_k", "page_size"},
                            /*summaries=*/true,
                            &ResolveQuest,
                            &QuestBytes,
                            &QuestSelect,
                            &WholePages,
                            PageSummaries::kTilePages};
  return *info;
}

}  // namespace

const AttentionModeInfo& QuestModeInfo() { return Info(); }

}  // namespace kvwire
