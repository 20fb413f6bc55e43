/* Batched decode attention over a compressed (or sparse-selected) KV cache: the kernels
 * (decode_attention.cu launches them). One warp per (sequence, query head) and chunk of attended
 * tokens (split-KV, as FlashInfer's decode splits: a warp walking 32K tokens alone left the GPU
 * idle). Lanes own head dimensions lane + 32·x; for each attended token (all `len`, or the
 * `indices` of the head's cache head) the score is a warp-reduced dot product and the softmax is
 * online, so any cache length works with constant shared memory. Each chunk writes its maximum, sum
 * and unnormalised output, and a second kernel merges a head's chunks (log-sum-exp). A batch that
 * asks for probabilities, or whose every head attends one chunk's worth, runs one pass, each
 * warp over all its tokens. K and V are read in the cache's dtype and widened in registers, or
 * read from a coded cache (fp8, int8, int4: cache_rows.cuh) and dequantised as they are read.
 * (FlashInfer's FP8 KV decode cannot read the coded caches: it takes one scale for all of K and
 * one for V, where the wire's keys carry an offset and a scale per channel and group of tokens.)
 * With `probs` set, a second pass writes each token's attention probability (for fidelity
 * measurements). A cache in one region or in pages (KvLayout): each row looked up in the
 * sequence's page table. Tested against ReferenceBackend::DecodeAttention (BackendOpsTest.* on
 * cuda) and, where no GPU is, in tests/kernels/emulated. */
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/backend.h"
#include "kernels/cuda/cache_rows.cuh"
#include "kernels/cuda/cuda_util.cuh"

namespace kvwire::kernels::cuda::plain_decode {

constexpr int kWarpsPerBlock = 4;
// A split makes a chunk per this many attended tokens (so each holds more than half of it).
constexpr int kSplitTokens = 256;
// Warps in flight a split aims at, at the most: four times what an H100 holds (132 SMs of 64),
// so that longer caches take longer chunks, not more scratch (items · chunks · (d + 2) floats).
constexpr int64_t kSplitWarps = 4 * 132 * 64;

// A chunk's running softmax state: its maximum and sum, and its unnormalised output [d].
struct Partial {
  float* m;
  float* l;
  float* acc;
};

// One warp's attention of query head h over cache head c, reading rows through `rows`
// (cache_rows.cuh: in the dtype, or coded and dequantised as read): its tokens [t0, t1) of the
// `count` attended, into seq.out, or (split) into `part` unnormalised for MergeChunks.
template <int DPL, typename Rows>
__device__ void AttendHead(const DecodeSequence& seq, const Rows& rows, int h, int c, int d,
                           float scale, int t0, int t1, const Partial* part) {
  const int lane = threadIdx.x % 32;
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
  for (int t = t0; t < t1; ++t) {
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
  if (part != nullptr) {
    if (lane == 0) {
      *part->m = m;
      *part->l = l;
    }
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) part->acc[dim] = acc[x];
    }
    return;
  }
  const int count = t1;
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

// Warp (blockIdx.x, warp) is item = (sequence, query head); blockIdx.y its chunk of
// `chunk_tokens` tokens (with `chunks` > 1: partials [item][chunk] in m, l and acc [.., d]).
template <typename T, int DPL>
__global__ void DecodeAttentionKernel(const DecodeSequence* __restrict__ seqs, int batch,
                                      int n_heads, int n_cache_heads, int d, float scale,
                                      int chunks, int chunk_tokens, float* part_m, float* part_l,
                                      float* part_acc) {
  const int warp = threadIdx.x / 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= static_cast<int64_t>(batch) * n_heads) return;
  const DecodeSequence& seq = seqs[item / n_heads];
  const int h = static_cast<int>(item % n_heads);
  const int c = h / (n_heads / n_cache_heads);
  const int count = seq.indices ? seq.num_indices : seq.len;
  int t0 = 0, t1 = count;
  Partial part{};
  if (chunks > 1) {
    t0 = static_cast<int>(min(int64_t{count}, int64_t{blockIdx.y} * chunk_tokens));
    t1 = min(count, t0 + chunk_tokens);
    const int64_t at = item * chunks + blockIdx.y;
    part = {part_m + at, part_l + at, part_acc + at * d};
  }
  // A region, or pages (their tables uploaded with seqs); a batch may mix coded caches and
  // caches in the dtype (the format is each request's).
  WithRows<T>(seq.k, seq.v, seq.layout, seq.coding, d, seq.len, [&](const auto& rows) {
    AttendHead<DPL>(seq, rows, h, c, d, scale, t0, t1, chunks > 1 ? &part : nullptr);
  });
}

// One warp per item: its chunks' partials merged (each scaled by exp(m_k - max)) into seq.out.
// A chunk past the item's tokens has l = 0 and m = -inf: it adds nothing.
template <int DPL>
__global__ void MergeChunks(const DecodeSequence* __restrict__ seqs, int batch, int n_heads, int d,
                            int chunks, const float* __restrict__ part_m,
                            const float* __restrict__ part_l, const float* __restrict__ part_acc) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= static_cast<int64_t>(batch) * n_heads) return;
  const float* m = part_m + item * chunks;
  const float* l = part_l + item * chunks;
  float mx = -INFINITY;
  for (int k = 0; k < chunks; ++k) mx = fmaxf(mx, m[k]);
  float sum = 0.f, acc[DPL];
#pragma unroll
  for (int x = 0; x < DPL; ++x) acc[x] = 0.f;
  for (int k = 0; k < chunks; ++k) {
    if (l[k] == 0.f) continue;
    const float w = __expf(m[k] - mx);
    sum += l[k] * w;
    const float* a = part_acc + (item * chunks + k) * d;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) acc[x] += a[dim] * w;
    }
  }
  const DecodeSequence& seq = seqs[item / n_heads];
  const int h = static_cast<int>(item % n_heads);
  const float inv = 1.f / sum;
#pragma unroll
  for (int x = 0; x < DPL; ++x) {
    const int dim = lane + 32 * x;
    if (dim < d) seq.out[static_cast<int64_t>(h) * d + dim] = acc[x] * inv;
  }
}

// How a call is cut: `chunks` blocks in y of `chunk_tokens` attended tokens each: enough for
// the longest head's tokens, unless probabilities are asked for (they need each head's whole
// softmax in one pass).
struct Split {
  int chunks = 1, chunk_tokens = 0;
};
__host__ inline Split SplitFor(const DecodeAttentionParams& p) {
  const int64_t items = static_cast<int64_t>(p.batch) * p.n_heads;
  int most = 0;
  bool probs = false;
  for (int b = 0; b < p.batch; ++b) {
    const DecodeSequence& s = p.seqs[b];
    most = std::max(most, s.indices ? s.num_indices : s.len);
    probs |= s.probs != nullptr;
  }
  int chunks = probs ? 1 : (most + kSplitTokens - 1) / kSplitTokens;
  chunks = static_cast<int>(std::clamp<int64_t>(
      chunks, 1, std::max<int64_t>(1, kSplitWarps / std::max<int64_t>(items, 1))));
  return {chunks, (most + chunks - 1) / chunks};
}

}  // namespace kvwire::kernels::cuda::plain_decode
