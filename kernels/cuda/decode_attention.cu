/* Launches the plain decode attention kernels (decode_attention.cuh says how they work): the
 * split of a call into chunks, their scratch, and the merge, which coded_decode.cu's split
 * shares. Tested against ReferenceBackend::DecodeAttention. */
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {

using plain_decode::DecodeAttentionKernel;
using plain_decode::kWarpsPerBlock;
using plain_decode::MergeChunks;
using plain_decode::SplitFor;

absl::Status LaunchDecodeAttention(const DecodeAttentionParams& p,
                                   const DecodeSequence* seqs_device, const OpMemory& mem,
                                   cudaStream_t stream) {
  if (p.batch == 0) return absl::OkStatus();
  const int64_t items = static_cast<int64_t>(p.batch) * p.n_heads;
  const int blocks = static_cast<int>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const plain_decode::Split split = SplitFor(p);
  const int chunks = split.chunks;
  float *part_m = nullptr, *part_l = nullptr, *part_acc = nullptr;
  if (chunks > 1) {
    const int64_t n = items * chunks;
    ASSIGN_OR_RETURN(void* scratch,
                     mem.scratch(kScratchWork, sizeof(float) * n * (2 + int64_t{p.head_dim})));
    part_m = static_cast<float*>(scratch);
    part_l = part_m + n;
    part_acc = part_l + n;
  }
  return DispatchDType(p.kv_dtype, [&]<typename T>() {
    return DispatchHeadDim(p.head_dim, [&]<int DPL>() {
      DecodeAttentionKernel<T, DPL><<<dim3(blocks, chunks), 32 * kWarpsPerBlock, 0, stream>>>(
          seqs_device, p.batch, p.n_heads, p.n_cache_heads, p.head_dim, p.scale, chunks,
          split.chunk_tokens, part_m, part_l, part_acc);
      RETURN_IF_ERROR(LaunchStatus("DecodeAttentionKernel"));
      if (chunks <= 1) return absl::OkStatus();
      return LaunchMergeDecodeChunks(p, seqs_device, chunks, part_m, part_l, part_acc, stream);
    });
  });
}

absl::Status LaunchMergeDecodeChunks(const DecodeAttentionParams& p,
                                     const DecodeSequence* seqs_device, int chunks,
                                     const float* part_m, const float* part_l,
                                     const float* part_acc, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.batch) * p.n_heads;
  const int blocks = static_cast<int>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return DispatchHeadDim(p.head_dim, [&]<int DPL>() {
    MergeChunks<DPL><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
        seqs_device, p.batch, p.n_heads, p.head_dim, chunks, part_m, part_l, part_acc);
    return LaunchStatus("MergeChunks");
  });
}

}  // namespace kvwire::kernels::cuda
