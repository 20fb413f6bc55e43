/* Batched decode attention over a compressed (or sparse-selected) KV cache.
 *
 * One warp per (sequence, query head). Lanes own head dimensions lane + 32·x; for each
 * attended token (all `len`, or the `indices` of the head's cache head) the score is a
 * warp-reduced dot product and the softmax is online, so any cache length works with
 * constant shared memory. K and V are read in the cache's dtype and widened in
 * registers. With `probs` set, a second pass writes each token's attention probability
 * (for fidelity measurements). A cache in one region or in pages (KvLayout): each row looked up
 * in the sequence's page table. Tested against ReferenceBackend::DecodeAttention. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"

namespace kvwire::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

template <typename T, int DPL>
__global__ void DecodeAttentionKernel(const DecodeSequence* __restrict__ seqs, int batch,
                                      int n_heads, int n_cache_heads, int d, float scale) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= static_cast<int64_t>(batch) * n_heads) return;
  const DecodeSequence& seq = seqs[item / n_heads];
  const int h = static_cast<int>(item % n_heads);
  const int c = h / (n_heads / n_cache_heads);
  const T* kb = static_cast<const T*>(seq.k);
  const T* vb = static_cast<const T*>(seq.v);
  const KvLayout& layout = seq.layout;  // a region, or pages (their table uploaded with seqs)
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
    const int64_t tok = idx ? idx[t] : t;
    const int64_t row = layout.Row(c, static_cast<int>(tok), d);
    const T* k = kb + row;
    const T* v = vb + row;
    float part = 0.f;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) part += q[x] * ToF32(k[dim]);
    }
    const float s = WarpSum(part) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = __expf(m - m_new);
    const float e = __expf(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      acc[x] = acc[x] * corr + (dim < d ? e * ToF32(v[dim]) : 0.f);
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
    const int64_t tok = idx ? idx[t] : t;
    const T* k = kb + layout.Row(c, static_cast<int>(tok), d);
    float part = 0.f;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) part += q[x] * ToF32(k[dim]);
    }
    const float s = WarpSum(part) * scale;
    if (lane == 0) probs[tok] = __expf(s - m) * inv;
  }
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
