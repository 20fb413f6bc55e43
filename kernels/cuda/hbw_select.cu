/* HbwSelect (kernels/selection.h): HBW-KV's hierarchical block selection. The blocks of each
 * row are ranked by TopK (CUB's sort), then one thread per row runs the rounds over that rank,
 * as the reference does: each group walks the rank list for its unselected blocks, best first.
 * The work is O(groups · blocks) per round and row, microseconds at the prompt lengths HBW-KV
 * is run at, so it is not worth a parallel formulation. */
#include <vector>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

__device__ int BlockSize(const HbwSelectParams& p, int b) {
  return min(p.prefix, (b + 1) * p.block) - b * p.block;
}

__global__ void HbwKernel(HbwSelectParams p, int n_blocks, const int32_t* ranks,
                          uint8_t* selected_all) {
  const int row = blockIdx.x;
  const int32_t* rank = ranks + static_cast<int64_t>(row) * n_blocks;
  uint8_t* selected = selected_all + static_cast<int64_t>(row) * n_blocks;
  for (int b = threadIdx.x; b < n_blocks; b += blockDim.x) selected[b] = 0;
  __syncthreads();
  if (threadIdx.x != 0) return;
  int used = 0;
  const int whole = p.prefix_budget / p.block;
  for (int r = 0; r < p.n_rounds; ++r) {
    const int round_blocks = whole / p.n_rounds + (r < whole % p.n_rounds ? 1 : 0);
    const int m_groups = min(p.rounds[r], n_blocks);
    for (int g = 0; g < m_groups; ++g) {
      const int quota = round_blocks / m_groups + (g < round_blocks % m_groups ? 1 : 0);
      const int b0 = static_cast<int>(static_cast<int64_t>(g) * n_blocks / m_groups);
      const int b1 = static_cast<int>(static_cast<int64_t>(g + 1) * n_blocks / m_groups);
      int taken = 0;
      for (int i = 0; i < n_blocks; ++i) {
        const int b = rank[i];
        if (b < b0 || b >= b1 || selected[b]) continue;
        if (taken == quota || used + BlockSize(p, b) > p.prefix_budget) break;
        selected[b] = 1;
        ++taken;
        used += BlockSize(p, b);
      }
    }
  }
  int partial_block = -1, partial_len = 0;
  for (int i = 0; i < n_blocks && used < p.prefix_budget; ++i) {
    const int b = rank[i];
    if (selected[b]) continue;
    if (used + BlockSize(p, b) <= p.prefix_budget) {
      selected[b] = 1;
      used += BlockSize(p, b);
    } else {
      partial_block = b;
      partial_len = p.prefix_budget - used;
      used = p.prefix_budget;
    }
  }
  int32_t* out = p.out + static_cast<int64_t>(row) * (p.prefix_budget + p.append);
  int n = 0;
  for (int b = 0; b < n_blocks; ++b) {
    const int len = selected[b] ? BlockSize(p, b) : (b == partial_block ? partial_len : 0);
    for (int j = b * p.block; j < b * p.block + len; ++j) out[n++] = j;
  }
  for (int j = 0; j < p.append; ++j) out[n++] = p.prefix + j;
}

}  // namespace

absl::Status LaunchHbwSelect(const HbwSelectParams& p, const OpMemory& mem, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidateHbwSelect(p));
  const int n_blocks = (p.prefix + p.block - 1) / p.block;
  const size_t rank_bytes = (sizeof(int32_t) * n_blocks * p.rows + 255) / 256 * 256;
  ASSIGN_OR_RETURN(void* work,
                   mem.scratch(kScratchWork, rank_bytes + size_t{1} * n_blocks * p.rows));
  auto* ranks = static_cast<int32_t*>(work);
  auto* selected = static_cast<uint8_t*>(work) + rank_bytes;
  std::vector<TopKSegment> segs(p.rows);
  for (int r = 0; r < p.rows; ++r) {
    segs[r].score = p.block_scores + static_cast<int64_t>(r) * n_blocks;
    segs[r].n = n_blocks;
    segs[r].k = n_blocks;
    segs[r].out = ranks + static_cast<int64_t>(r) * n_blocks;
  }
  RETURN_IF_ERROR(LaunchTopK({segs.data(), p.rows, false}, mem, stream));
  HbwKernel<<<p.rows, 256, 0, stream>>>(p, n_blocks, ranks, selected);
  return LaunchStatus("HbwKernel");
}

}  // namespace kvwire::kernels::cuda
