/* Batched decode attention over a compressed (or sparse-selected) KV cache.
 *
 * One warp per (sequence, query head). Lanes own head dimensions lane + 32·x; for each
 * attended token (all `len`, or the `indices` of the head's cache head) the score is a
 * warp-reduced dot product and the softmax is online, so any cache length works with
 * constant shared memory. K and V are read in the cache's dtype and widened in registers, or
 * read from a coded cache (fp8, int8, int4: cache_rows.cuh) and dequantised as they are read.
 * (FlashInfer's FP8 KV decode cannot read the coded caches: it takes one scale for all of K and
 * one for V, where the wire's keys carry an offset and a scale per channel and group of tokens.)
 * With `probs` set, a second pass writes each token's attention probability (for fidelity
 * measurements). A cache in one region or in pages (KvLayout): each row looked up in the
 * sequence's page table. Tested against ReferenceBackend::DecodeAttention. */
#include "kernels/cuda/cache_rows.cuh"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

// One warp's attention of query head h over cache head c, reading rows through `rows`
// (cache_rows.cuh: in the dtype, or coded and dequantised as read).
template <int DPL, typename Rows>
__device__ void AttendHead(const DecodeSequence& seq, const Rows& rows, int h, int c, int d,
                           float scale) {
  const int lane = threadIdx.x % 32;
  const int count = seq.indices ? seq.num_indices : seq.len;
  const int32_t* idx =
      seq.indices ? seq.indices + static_cast<int64_t>(c) * seq.num_indices : nullptr;

  float q[DPL], acc[DPL];
#pragma unroll
  for (int x = 0; x < DPL; ++x) {
    const int dim = lane + 32 * x;
    q[x] = dim < d ? seq.q[static_cast<int64_t>(h) * d + dim] : 0.f;
    acc[x] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int t = 0; t < count; ++t) {
    const auto tok = rows.At(c, idx ? idx[t] : t);
    float part = 0.f;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) part += q[x] * tok.key(dim);
    }
    const float s = WarpSum(part) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = __expf(m - m_new);
    const float e = __expf(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      acc[x] = acc[x] * corr + (dim < d ? e * tok.value(dim) : 0.f);
    }
    m = m_new;
  }
  const float inv = 1.f / l;
#pragma unroll
  for (int x = 0; x < DPL; ++x) {
    const int dim = lane + 32 * x;
    if (dim < d) seq.out[static_cast<int64_t>(h) * d + dim] = acc[x] * inv;
  }
  if (seq.probs == nullptr) return;
  float* probs = seq.probs + static_cast<int64_t>(h) * seq.len;
  for (int t = lane; t < seq.len; t += 32) probs[t] = 0.f;
  __syncwarp();
  for (int t = 0; t < count; ++t) {
    const int tok_id = idx ? idx[t] : t;
    const auto tok = rows.At(c, tok_id);
    float part = 0.f;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) part += q[x] * tok.key(dim);
    }
    const float s = WarpSum(part) * scale;
    if (lane == 0) probs[tok_id] = __expf(s - m) * inv;
  }
}

template <typename T, int DPL>
__global__ void DecodeAttentionKernel(const DecodeSequence* __restrict__ seqs, int batch,
                                      int n_heads, int n_cache_heads, int d, float scale) {
  const int warp = threadIdx.x / 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= static_cast<int64_t>(batch) * n_heads) return;
  const DecodeSequence& seq = seqs[item / n_heads];
  const int h = static_cast<int>(item % n_heads);
  const int c = h / (n_heads / n_cache_heads);
  // A region, or pages (their tables uploaded with seqs); a batch may mix coded caches and
  // caches in the dtype (the format is each request's).
  WithRows<T>(seq.k, seq.v, seq.layout, seq.coding, d, seq.len,
              [&](const auto& rows) { AttendHead<DPL>(seq, rows, h, c, d, scale); });
}

}  // namespace

absl::Status LaunchDecodeAttention(const DecodeAttentionParams& p,
                                   const DecodeSequence* seqs_device, cudaStream_t stream) {
  if (p.batch == 0) return absl::OkStatus();
  const int64_t items = static_cast<int64_t>(p.batch) * p.n_heads;
  const int blocks = static_cast<int>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return DispatchDType(p.kv_dtype, [&]<typename T>() {
    return DispatchHeadDim(p.head_dim, [&]<int DPL>() {
      DecodeAttentionKernel<T, DPL><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
          seqs_device, p.batch, p.n_heads, p.n_cache_heads, p.head_dim, p.scale);
      return LaunchStatus("DecodeAttentionKernel");
    });
  });
}

}  // namespace kvwire::kernels::cuda
