// The CPU backend's selection ops (kernels/selection.h), one file per op in this folder, and
// the per-item functions the host sparse-decode path calls on its own threads (a host
// backend selects and attends each cache head in one task: common/model/decode_attention.cc).
// Parameters are validated by the caller.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/selection.h"

namespace kvwire::kernels::cpu {

// Runs fn(begin, end) over ranges covering [0, n) (the backend's thread pool).
using ParallelFn = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& fn)>;

void WindowVotes(const WindowVotesParams& p, const ParallelFn& parallel);  // window_votes.cc
void Pool1d(const Pool1dParams& p, const ParallelFn& parallel);            // pool1d.cc
void TopK(const TopKParams& p, const ParallelFn& parallel);                // top_k.cc
void GatherKv(const GatherKvParams& p, const ParallelFn& parallel);        // gather_kv.cc
void UpdateSummaries(const UpdateSummariesParams& p, const ParallelFn& parallel);  // summaries.cc
void PageScores(const PageScoresParams& p, const ParallelFn& parallel);            // page_scores.cc
void Sample(const SampleParams& p, const ParallelFn& parallel);                    // sample.cc

// One segment's items, on the calling thread.
// The k best of n items, item j scoring score[j / run], in the ranking order (TopKSegment),
// found by partial selection (BestFirstPrefix), not a sort of all of them.
void TakeBest(const float* score, int run, int n, int k, bool ascending, int32_t* out);
// Cache head `head` of a summary update.
void UpdateHeadSummaries(const SummaryUpdateSegment& s, int head);
// One cache head's page (or token) scores.
void HeadPageScores(const PageScoreSegment& s, int head_dim, DType dtype);

}  // namespace kvwire::kernels::cpu
