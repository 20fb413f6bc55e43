/* WindowVotes: SnapKV's observation-window votes reduced over groups of query heads
 * (kernels/selection.h). A thread per (output row, column): it sums each head's window rows
 * over i in order, then reduces the group in order, as the reference does; a warp's threads
 * read consecutive columns of one score row. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

__global__ void WindowVotesKernel(WindowVotesParams p) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int r = blockIdx.y;
  if (j >= p.prefix) return;
  float acc = p.reduce == VoteReduce::kMax ? -INFINITY : 0.f;
  for (int x = 0; x < p.group; ++x) {
    const int h = r * p.group + x;
    const float* col = p.scores + static_cast<int64_t>(h) * p.window * p.len + j;
    float vote = 0.f;
    for (int i = 0; i < p.window; ++i) vote += col[static_cast<int64_t>(i) * p.len];
    // std::max(acc, vote): acc unless acc < vote (a NaN vote never wins).
    acc = p.reduce == VoteReduce::kMax ? (acc < vote ? vote : acc) : acc + vote;
  }
  p.votes[static_cast<int64_t>(r) * p.prefix + j] =
      p.reduce == VoteReduce::kMean ? acc / p.group : acc;
}

}  // namespace

absl::Status LaunchWindowVotes(const WindowVotesParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateWindowVotes(p));
  const int rows = p.n_heads / p.group;
  if (rows > 65535) return absl::InvalidArgumentError("WindowVotes: more than 65535 rows");
  const dim3 grid((p.prefix + 255) / 256, rows);
  WindowVotesKernel<<<grid, 256, 0, stream>>>(p);
  return LaunchStatus("WindowVotesKernel");
}

}  // namespace kvwire::kernels::cuda
