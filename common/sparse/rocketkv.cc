// Hybrid sparse attention (RocketKV Algorithm 2), per KV head and its `group` query heads:
//   1-2  page summaries: element-wise min and max of each page of P keys (page_summaries.h)
//   3    the r head dimensions with the largest Σ_g |q_g| over the group
//   4-6  per dimension K_max where Σ_g q ≥ 0, else K_min: approximate page logits per query
//        head, SparQ-scaled; a softmax per head over slots, summed over the group
//   7    the top-k tokens (whole pages best first), exact attention over them (the kernel)
// and the two-stage budget split of Section 3.5. docs/algorithms.md §3 specifies both.
#include "common/sparse/rocketkv.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/base/ranking.h"
#include "common/base/status.h"
#include "kernels/cpu/selection.h"

namespace kvwire {
namespace {

// Lines 3-6 score the pages (kernels/cpu/page_scores.cc, the same code the backend op runs);
// line 7 takes the top-k tokens, whole pages best first.
void HybridSelect(const HeadQuery& hq) {
  const LayerCache& lc = *hq.cache;
  thread_local std::vector<float> score;
  score.resize(hq.summaries->pages(lc.len));
  kernels::PageScoreSegment s;
  s.kind = kernels::PageScoreKind::kHybrid;
  s.q = hq.q;
  s.group = hq.group;
  s.len = lc.len;
  s.summaries = hq.summaries->HeadBlock(hq.layer, hq.head);
  s.layout = hq.summaries->Layout(hq.layer);
  s.top_r = hq.params->top_r;
  s.score = score.data();
  kernels::cpu::HeadPageScores(s, lc.head_dim, lc.dtype);
  TakePages(score, hq.summaries->page(), lc.len, hq.params->top_k, hq.out);  // line 7
}

// Half the budget to the sparse attention, half to the approximation; page size and r
// split the stage-2 ratio c2 = capacity / t (authors' code, docs §3.4).
absl::StatusOr<SparseParams> ResolveHybrid(const DecodeAttentionConfig& c, int capacity,
                                           int head_dim) {
  SparseParams p;
  p.mode = AttentionMode::kHybrid;
  const int t = c.token_budget;
  const double c2 = t > 0 ? std::max(1.0, static_cast<double>(capacity) / t) : 1.0;
  p.page_size = std::max(
      1, std::min(static_cast<int>(std::floor(c2)), static_cast<int>(std::ceil(std::sqrt(c2)))));
  p.top_r =
      std::min(head_dim, std::max(1, static_cast<int>(std::lround(head_dim * p.page_size / c2))));
  p.top_k = t > 0 ? std::max(1, static_cast<int>(std::lround(t / 2.0))) : 0;
  return p;
}

// k tokens, and r of the d dimensions of one summary row per page.
int64_t HybridBytes(const SparseParams& p, int len, int64_t row, int64_t es) {
  const int64_t pages = (len + p.page_size - 1) / p.page_size;
  return 2 * row * p.top_k + pages * p.top_r * es;
}

const AttentionModeInfo& Info() {
  static const AttentionModeInfo* const info =
      new AttentionModeInfo{AttentionMode::kHybrid,
                            "hybrid",
                            "RocketKV, Algorithm 2 (stage 2)",
                            {"token_budget", "top_k", "top_r", "page_size"},
                            /*summaries=*/true,
                            &ResolveHybrid,
                            &HybridBytes,
                            &HybridSelect};
  return *info;
}

}  // namespace

const AttentionModeInfo& HybridModeInfo() { return Info(); }

absl::StatusOr<TwoStage> ResolveRocketKV(int token_budget, int prompt_len, int max_new,
                                         int head_dim, const CompressionConfig& base) {
  if (token_budget < 2) {
    return AboutField(absl::InvalidArgumentError(absl::StrCat(
                          "rocketkv needs a token budget of at least 2, got ", token_budget)),
                      "compression.budget");
  }
  // The two-stage policy's own parameters: SnapKV++'s for stage 1, and the split.
  ParamValues stage1 = base.policy->selects() ? ParamValues{} : base.policy->params();
  const bool paper = stage1["budget_split"] == "sqrt";
  stage1.erase("budget_split");
  const double s = prompt_len + max_new;
  const double t = std::min<double>(s, token_budget);
  const double c = std::max(1.0, s / t);
  // The stage-1 ratio is c^α: the paper's √c (α = 1/2), or the authors' code's
  // α = min(0.2 + 0.06·log2 c, 0.8) (docs/algorithms.md §3.4).
  const double alpha = paper ? 0.5 : std::min(0.2 + 0.06 * std::log2(c), 0.8);
  const int capacity = static_cast<int>(s / std::pow(c, alpha));
  TwoStage out;
  out.stage1 = base;
  ASSIGN_OR_RETURN(out.stage1.policy, MakePolicy("snapkv_pp", stage1));
  out.stage1.ratio = 0;
  // The code's prompt_budget = min(S - max_new, capacity - max_new); when max_new eats the
  // whole capacity it would leave nothing, so stage 1 keeps at least the window and one.
  out.stage1.budget = std::max(base.window + 1, std::min(prompt_len, capacity - max_new));
  out.stage2.mode = AttentionMode::kHybrid;
  out.stage2.token_budget = token_budget;
  // Stage 2's ratio c2 = capacity / t is split between the page size and r: the paper's
  // c2^(1/2) each (c^(1/4)), or the code's P = min(⌊c2⌋, ⌈√c2⌉).
  const double c2 = std::max(1.0, capacity / t);
  out.stage2.page_size = paper ? std::max(1, static_cast<int>(std::lround(std::sqrt(c2))))
                               : std::max(1, std::min(static_cast<int>(std::floor(c2)),
                                                      static_cast<int>(std::ceil(std::sqrt(c2)))));
  out.stage2.top_r = std::min(
      head_dim, std::max(1, static_cast<int>(std::lround(head_dim * out.stage2.page_size / c2))));
  out.stage2.top_k = paper ? std::max(1, std::min(static_cast<int>(t) / 2, capacity))
                           : std::max(1, std::min(static_cast<int>(std::lround(t / 2)), capacity));
  return out;
}

absl::Status ResolveTwoStage(CompressionConfig* compression, DecodeAttentionConfig* attention,
                             int prompt_len, int max_new, int head_dim) {
  if (!compression->policy->selects()) {
    ASSIGN_OR_RETURN(TwoStage two, ResolveRocketKV(compression->budget, prompt_len, max_new,
                                                   head_dim, *compression));
    *compression = two.stage1;
    *attention = two.stage2;
  }
  // The layers the compression kept whole attend densely (RocketKV's reference).
  if (attention->mode != AttentionMode::kDense) attention->dense_layers = compression->skip_layers;
  return absl::OkStatus();
}

}  // namespace kvwire
