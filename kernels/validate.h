// Parameter checks shared by every backend, so that all of them reject the same bad
// shapes with the same message.
#pragma once

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace kvwire::kernels {

absl::Status ValidateMatMul(const MatMulParams& p);
absl::Status ValidateRmsNorm(const RmsNormParams& p);
absl::Status ValidateRope(const RopeParams& p);
absl::Status ValidateSwiGlu(const SwiGluParams& p);
absl::Status ValidatePrefillAttention(const PrefillAttentionParams& p);
absl::Status ValidateDecodeAttention(const DecodeAttentionParams& p);
absl::Status ValidateEmbedRows(const EmbedRowsParams& p);
absl::Status ValidateAppendKv(const AppendKvParams& p);
absl::Status ValidateWindowVotes(const WindowVotesParams& p);
absl::Status ValidatePool1d(const Pool1dParams& p);
absl::Status ValidateRunMeans(const RunMeansParams& p);
absl::Status ValidateTopK(const TopKParams& p);
absl::Status ValidateHbwSelect(const HbwSelectParams& p);
absl::Status ValidateGatherKv(const GatherKvParams& p);
absl::Status ValidateUpdateSummaries(const UpdateSummariesParams& p);
absl::Status ValidatePageScores(const PageScoresParams& p);
absl::Status ValidateSample(const SampleParams& p);
absl::Status ValidateChecksumSpans(const ChecksumSpansParams& p);
absl::Status ValidatePackSpans(const PackSpansParams& p);

}  // namespace kvwire::kernels
