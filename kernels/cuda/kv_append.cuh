/* AppendKv's kernel (kv_append.cu launches it): each sequence's new K and V rows (float32, after
 * RoPE) stored in its cache's dtype at token t of every cache head, one block per (sequence,
 * cache head, K or V), a thread per element; a coded cache's token goes into its residual,
 * coded a group at a time. Tested against the host backends' loops (kernels/host_memory.h) by
 * BackendOpsTest.AppendKv and CodedCacheTest.* on cuda, and where no GPU is in
 * tests/kernels/emulated. */
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/base/kv_format.h"
#include "kernels/backend.h"
#include "kernels/coded_rows.h"
#include "kernels/cuda/cuda_util.cuh"

namespace kvwire::kernels::cuda::append_kv {

// A block's threads: a warp per 32 elements of a row, up to 256.
__host__ inline int ThreadsFor(int head_dim) { return std::min(256, (head_dim + 31) / 32 * 32); }

// A coded cache's token t (KvCoding; kernels/coded_rows.h's AppendCodedRow is the
// specification): its rows into the residual, and when they complete a group, the group coded
// into its code rows and parameters with the host's own coders (common/base/kv_format.h), so
// that the device's codes are the host's, bit for bit. One block per (sequence, cache head).
template <typename T>
__device__ void AppendCoded(const KvAppend& s, int c, const float* k_src, const float* v_src, int d,
                            DType dtype) {
  __shared__ float amax_of[32];
  const KvCoding& coding = s.coding;
  const KvFormat f = coding.format;
  const int first = coding.ResidBegin(s.t);  // the residual's first token
  auto* k_resid =
      reinterpret_cast<T*>(static_cast<uint8_t*>(coding.k_resid) + ResidAt(coding, dtype, d, c, 0));
  auto* v_resid =
      reinterpret_cast<T*>(static_cast<uint8_t*>(coding.v_resid) + ResidAt(coding, dtype, d, c, 0));
  const int64_t slot = int64_t{s.t - first} * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    k_resid[slot + i] = FromF32<T>(k_src[i]);
    v_resid[slot + i] = FromF32<T>(v_src[i]);
  }
  if (s.t + 1 - first < kKeyGroupTokens) return;  // the same for every thread of the block
  __syncthreads();                                // the residual's last rows, written above
  const int g = KvGroups{coding.kept}.Of(first);
  constexpr int n = kKeyGroupTokens;
  auto* k_codes = static_cast<uint8_t*>(s.k_cache);
  auto* v_rows = static_cast<uint8_t*>(s.v_cache);
  const int kc = CodedKeyRowBytes(f, d), vc = CodedValueRowBytes(f, d);
  // Keys: a thread per byte of the code rows (int4's two channels of a byte in one thread).
  const int per_byte = f == KvFormat::kInt4 ? 2 : 1;
  uint8_t* params = coding.k_params + KeyParamsAt(coding, d, c, g);
  for (int j = threadIdx.x; j < kc; j += blockDim.x) {
    for (int ch = j * per_byte; ch < (j + 1) * per_byte; ++ch) {
      CodeKeyChannel(
          f, ch, n, [&](int r) { return ToF32(k_resid[int64_t{r} * d + ch]); },
          [&](int r) { return k_codes + s.layout.Row(c, first + r, kc); }, params);
    }
  }
  // Values: a thread per row; fp8's rows share the group's scale, a block-wide maximum.
  float scale_inverse = 0.f, amax = 0.f;
  if (f == KvFormat::kFP8) {
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
      for (int i = 0; i < d; ++i) amax = fmaxf(amax, fabsf(ToF32(v_resid[int64_t{r} * d + i])));
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x % 32 == 0) amax_of[threadIdx.x / 32] = amax;
    __syncthreads();
    for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) amax = fmaxf(amax, amax_of[w]);
    const uint8_t scale = E8M0Up(amax, kE4M3Max);
    if (threadIdx.x == 0) coding.v_scales[int64_t{c} * coding.max_groups + g] = scale;
    scale_inverse = 1.0f / E8M0ToFloat(scale);  // a power of two: exactly the division
  }
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    const T* x = v_resid + int64_t{r} * d;
    uint8_t* out = v_rows + coding.v_layout.Row(c, first + r, vc);
    if (f == KvFormat::kFP8) {
      for (int i = 0; i < d; ++i) out[i] = amax > 0 ? FloatToE4M3(ToF32(x[i]) * scale_inverse) : 0;
    } else {
      CodeIntValueRow(
          f, d, [&](int i) { return ToF32(x[i]); }, out);
    }
  }
}

template <typename T>
__global__ void AppendKvKernel(const KvAppend* __restrict__ seqs, int n_kv_heads, int n_cache_heads,
                               int d, DType dtype) {
  const int item = blockIdx.x;  // ((b · n_cache_heads) + c) · 2 + (0: K, 1: V)
  const int which = item % 2;
  const int c = (item / 2) % n_cache_heads;
  const KvAppend& s = seqs[item / 2 / n_cache_heads];
  const int g = c / (n_cache_heads / n_kv_heads);
  if (s.coding.coded()) {  // K's block writes both (a group codes K and V together)
    if (which == 0) AppendCoded<T>(s, c, s.k + int64_t{g} * d, s.v + int64_t{g} * d, d, dtype);
    return;
  }
  const float* src = (which == 0 ? s.k : s.v) + static_cast<int64_t>(g) * d;
  T* dst = static_cast<T*>(which == 0 ? s.k_cache : s.v_cache) + s.layout.Row(c, s.t, d);
  for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = FromF32<T>(src[i]);
}

}  // namespace kvwire::kernels::cuda::append_kv
