/* Causal GQA prefill attention with observation-window scores.
 *
 * One warp per (query row i, query head h): lanes own head dimensions lane + 32·x, each
 * key's score is a warp-reduced dot product, and the softmax is online (running max m,
 * running sum l, rescaled accumulator), so memory stays O(L·d) for any prompt length.
 * Rows among the last `window` then make a second pass over all keys to write
 * exp(s - m) / l (zero above the diagonal): SnapKV's window scores. This is the plain,
 * obviously-correct kernel; it is tested against ReferenceBackend::PrefillAttention. */
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/validate.h"

namespace kvwire::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

template <int DPL>
__global__ void PrefillAttentionKernel(PrefillAttentionParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= static_cast<int64_t>(p.len - p.q_begin) * p.n_heads) return;
  const int i = p.q_begin + static_cast<int>(item / p.n_heads);
  const int h = static_cast<int>(item % p.n_heads);
  const int g = h / (p.n_heads / p.n_kv_heads);
  const int d = p.head_dim;

  float q[DPL], acc[DPL];
#pragma unroll
  for (int x = 0; x < DPL; ++x) {
    const int dim = lane + 32 * x;
    q[x] = dim < d ? p.q[i * p.q_stride + static_cast<int64_t>(h) * d + dim] : 0.f;
    acc[x] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j <= i; ++j) {
    const float* k = p.k + j * p.kv_stride + static_cast<int64_t>(g) * d;
    const float* v = p.v + j * p.kv_stride + static_cast<int64_t>(g) * d;
    float part = 0.f;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) part += q[x] * k[dim];
    }
    const float s = WarpSum(part) * p.scale;
    const float m_new = fmaxf(m, s);
    const float corr = __expf(m - m_new);
    const float e = __expf(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      acc[x] = acc[x] * corr + (dim < d ? e * v[dim] : 0.f);
    }
    m = m_new;
  }
  const float inv = 1.f / l;
#pragma unroll
  for (int x = 0; x < DPL; ++x) {
    const int dim = lane + 32 * x;
    if (dim < d) p.out[i * p.out_stride + static_cast<int64_t>(h) * d + dim] = acc[x] * inv;
  }

  const int wrow = i - (p.len - p.window);
  if (p.window == 0 || wrow < 0) return;
  float* ws = p.window_scores + (static_cast<int64_t>(h) * p.window + wrow) * p.len;
  for (int j = 0; j < p.len; ++j) {
    if (j > i) {
      if (lane == 0) ws[j] = 0.f;
      continue;
    }
    const float* k = p.k + j * p.kv_stride + static_cast<int64_t>(g) * d;
    float part = 0.f;
#pragma unroll
    for (int x = 0; x < DPL; ++x) {
      const int dim = lane + 32 * x;
      if (dim < d) part += q[x] * k[dim];
    }
    const float s = WarpSum(part) * p.scale;
    if (lane == 0) ws[j] = __expf(s - m) * inv;
  }
}

}  // namespace

absl::Status LaunchPrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(ValidatePrefillAttention(p));
  const int64_t items = static_cast<int64_t>(p.len - p.q_begin) * p.n_heads;
  const int blocks = static_cast<int>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return DispatchHeadDim(p.head_dim, [&]<int DPL>() {
    PrefillAttentionKernel<DPL><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(p);
    return LaunchStatus("PrefillAttentionKernel");
  });
}

}  // namespace kvwire::kernels::cuda
