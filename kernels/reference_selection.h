// The reference backend's selection ops (reference_selection.cc): the specification of the ops
// of kernels/selection.h, on host memory. Parameters are validated by the caller.
#pragma once

#include "kernels/selection.h"

namespace kvwire::kernels::reference {

void WindowVotes(const WindowVotesParams& p);
void Pool1d(const Pool1dParams& p);
void RunMeans(const RunMeansParams& p);
void TopK(const TopKParams& p);
void HbwSelect(const HbwSelectParams& p);
void GatherKv(const GatherKvParams& p);
void UpdateSummaries(const UpdateSummariesParams& p);
void PageScores(const PageScoresParams& p);
void Sample(const SampleParams& p);

}  // namespace kvwire::kernels::reference
