/* Dense decode attention over coded caches: the kernel (coded_decode.cu launches it, and
 * coded_decode.h says which calls it serves; kernels/coded_rows.h is the specification). The plain
 * kernel (decode_attention.cu) gives each query head a warp that walks the tokens one by one,
 * re-reading the key group's parameters for every channel of every token and the rows once per
 * query head: on a coded cache the parameters' bytes exceed the codes'. Here, as the CPU kernel
 * (kernels/cpu/decode_coded.cc) does:
 *   - a block is a (sequence, cache head) and a run of its key groups (split-KV; the residual,
 *     the appended tokens not yet coded, is a unit of its own after the groups), and all the
 *     cache head's query heads (GQA) are attended together, so each row is read once;
 *   - per key group the block folds the group's parameters into the queries once: a key is
 *     a + b·code per channel, so q·k = q·a + (q∘b)·codes;
 *   - scores: a thread per token of the group (groups are at most kKeyGroupTokens tokens), its
 *     code row read in 16-byte loads, the folded queries broadcast from shared memory; then the
 *     group's online softmax (max and sum over the block), each weight multiplied by its row's
 *     scale (int8), group scale (fp8) or step (int4), and int4's minimums summed apart;
 *   - values: rows of d / 4 threads, each four channels, read a row together (coalesced), and
 *     add it to every query head's output; the rows of threads are summed at the end.
 * Codes are widened by bit arithmetic (an integer op and an add) rather than conversion
 * instructions, which run at a quarter of the rate. Partials of a split are merged by
 * decode_attention.cu's MergeChunks. Tested against the reference by CodedCacheTest.* and
 * DeviceEngine.CodedCachesEqualTheCpuEngine on cuda. */
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/base/kv_format.h"
#include "kernels/backend.h"
#include "kernels/coded_rows.h"
#include "kernels/cuda/cuda_util.cuh"

namespace kvwire::kernels::cuda::coded_decode {

constexpr int kThreads = kKeyGroupTokens;  // a thread per token of a key group
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "a whole number of warps");
constexpr int kWarps = kThreads / 32;
constexpr int kMaxDim = 256;
// int4 value rows carry a {step, min} per kInt4ValueGroup channels.
constexpr int kMaxChannelGroups = (kMaxDim + kInt4ValueGroup - 1) / kInt4ValueGroup;

// A cache head's units of work: its coded key groups, then (if any) its residual. Sets
// *coded to the number of coded groups and *resid_begin to the residual's first token.
__host__ __device__ inline int CodedUnits(const KvCoding& coding, int len, int* coded,
                                          int* resid_begin) {
  *resid_begin = coding.ResidBegin(len);
  *coded = *resid_begin > 0 ? KvGroups{coding.kept}.Of(*resid_begin - 1) + 1 : 0;
  return *coded + (len > *resid_begin ? 1 : 0);
}

// How a call is cut: `per` units of each cache head to a block, `chunks` blocks in y. Enough
// blocks to fill the GPU (eight per SM of an H100's 132), so that a batch of few sequences
// still does and a large one is not cut finer than it needs; no more chunks than units, and
// within the grid's 65535 in y.
struct Split {
  int per = 1, chunks = 1;
};
inline constexpr int64_t kSplitBlocks = 8 * 132;
__host__ inline Split SplitFor(const DecodeAttentionParams& p) {
  const int64_t items = int64_t{p.batch} * p.n_cache_heads;
  int most = 1;
  for (int b = 0; b < p.batch; ++b) {
    int coded = 0, resid_begin = 0;
    most = std::max(most, CodedUnits(p.seqs[b].coding, p.seqs[b].len, &coded, &resid_begin));
  }
  int64_t want = std::max<int64_t>(1, (kSplitBlocks + items - 1) / items);
  want = std::min<int64_t>({want, most, 65535});
  Split split;
  split.per = static_cast<int>((most + want - 1) / want);
  split.chunks = (most + split.per - 1) / split.per;
  return split;
}

// An unsigned integer below 2^23 as a float, exactly: its bits under 2^23's exponent, less 2^23.
__device__ __forceinline__ float SmallToFloat(uint32_t n) {
  return __uint_as_float(0x4B000000u | n) - 8388608.f;
}

// E4M3 (x's low byte) as a float, as E4M3ToFloat decodes it: exponent and mantissa shifted under
// a float's and rebased by 2^120. A subnormal code becomes a float subnormal that the product
// scales exactly (CUDA keeps float denormals unless built with -ftz, which kvwire is not).
__device__ __forceinline__ float E4M3Bits(uint32_t x) {
  const uint32_t em = x & 0x7Fu;
  float v = __uint_as_float(em << 20) * 0x1p120f;
  if (em == 0x7Fu) v = __uint_as_float(0x7FC00000u);
  return __uint_as_float(__float_as_uint(v) | ((x & 0x80u) << 24));
}

// Code j of a 32-bit word of key codes (4 bytes, or 8 nibbles with the even channel low).
template <KvFormat F>
__device__ __forceinline__ float KeyCode(uint32_t word, int j) {
  if constexpr (F == KvFormat::kInt4) {
    return SmallToFloat((word >> (4 * j)) & 0xFu);
  } else if constexpr (F == KvFormat::kInt8) {
    return SmallToFloat((word >> (8 * j)) & 0xFFu);
  } else {
    return E4M3Bits(word >> (8 * j));
  }
}

// Channels [ch, ch + 4) of a value row, before its scale (int4: codes before step and min).
// ch is a multiple of 4 and rows start on 4-byte (fp8) or 2-byte boundaries (CodedDecodeServes),
// so the loads align.
template <KvFormat F>
__device__ __forceinline__ void ValueCodes(const uint8_t* row, int ch, float* x) {
  if constexpr (F == KvFormat::kInt4) {
    const uint32_t h = *reinterpret_cast<const uint16_t*>(row + ch / 2);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = SmallToFloat((h >> (4 * k)) & 0xFu);
  } else if constexpr (F == KvFormat::kInt8) {  // int8 rows are d + 2 bytes: 2-byte loads
    const uint32_t w = *reinterpret_cast<const uint16_t*>(row + ch) |
                       (uint32_t{*reinterpret_cast<const uint16_t*>(row + ch + 2)} << 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // signed: s + 128 as above, less 2^23 + 128
      x[k] = __uint_as_float(0x4B000000u | (((w >> (8 * k)) & 0xFFu) ^ 0x80u)) - 8388736.f;
    }
  } else {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + ch);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = E4M3Bits(w >> (8 * k));
  }
}

template <int G>
struct Fold {
  float q[G][kMaxDim];   // the cache head's query heads
  float qb[G][kMaxDim];  // q ∘ b of the key group being read
};

template <int G>
struct alignas(16) SharedState {
  union {
    Fold<G> fold;
    // At the end: each row of threads' value sums, [row][G][d] (rows · d = 4 · kThreads).
    float acc[2 * G * kMaxDim];
  };
  float qa[G];                                   // q · a of the key group
  float w[G][kMaxChannelGroups][kThreads];       // each token's weight × its row's scale
  float red_max[kWarps][G], red_sum[kWarps][G];  // per warp: the group's maximum and sum
  float red_min[kWarps][G][kMaxChannelGroups];   // per warp: int4's Σ weight · minimum
};
static_assert(4 * kThreads <= 2 * kMaxDim, "the value rows' sums fit in the fold's space");

// A token's key scores s[g] += (q∘b)_g · codes, the row's codes in 16-byte loads and the
// folded queries in 4-float loads, broadcast (every thread reads the same channels).
template <KvFormat F, int G>
__device__ __forceinline__ void KeyDots(const uint8_t* row, int d, const float (*qb)[kMaxDim],
                                        float* s) {
  constexpr int kPerWord = F == KvFormat::kInt4 ? 8 : 4;
  const int bytes = CodedKeyRowBytes(F, d);
  for (int at = 0; at < bytes; at += 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + at);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    const int ch0 = at * (kPerWord / 4);
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
      for (int j0 = 0; j0 < kPerWord; j0 += 4) {
        const int i = ch0 + wi * kPerWord + j0;
        float x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = KeyCode<F>(words[wi], j0 + j);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 q4 = *reinterpret_cast<const float4*>(&qb[g][i]);
          s[g] = fmaf(q4.x, x[0], s[g]);
          s[g] = fmaf(q4.y, x[1], s[g]);
          s[g] = fmaf(q4.z, x[2], s[g]);
          s[g] = fmaf(q4.w, x[3], s[g]);
        }
      }
    }
  }
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Block (blockIdx.x = b · n_cache_heads + c, blockIdx.y = chunk): the query heads c·G .. c·G + G
// − 1 of sequence b over units [chunk · units_per_chunk, + units_per_chunk) of cache head c,
// into seq.out (chunks = 1) or unnormalised partials for LaunchMergeDecodeChunks.
template <typename T, int G, KvFormat F>
__device__ void AttendCoded(SharedState<G>& sh, const DecodeSequence& seq, int b, int c, int d,
                            int n_heads, float scale, int chunks, int units_per_chunk,
                            float* part_m, float* part_l, float* part_acc) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const KvCoding& coding = seq.coding;
  const KvGroups groups{coding.kept};
  int coded = 0, resid_begin = 0;
  const int units = CodedUnits(coding, seq.len, &coded, &resid_begin);
  const int first = static_cast<int>(min(int64_t{units}, int64_t{blockIdx.y} * units_per_chunk));
  const int last = min(units, first + units_per_chunk);
  const int kc = CodedKeyRowBytes(F, d), vc = CodedValueRowBytes(F, d);
  const auto* keys = static_cast<const uint8_t*>(seq.k);
  const auto* values = static_cast<const uint8_t*>(seq.v);
  const int channel_groups = F == KvFormat::kInt4 ? (d + kInt4ValueGroup - 1) / kInt4ValueGroup : 1;

  for (int e = tid; e < G * d; e += kThreads) {
    sh.fold.q[e / d][e % d] = seq.q[int64_t{c} * G * d + e];
  }
  // Value rows: d / 4 threads to a row, each channels [ch, ch + 4); `rows` rows at a time.
  const int row_threads = d / 4, rows = kThreads / row_threads;
  const int ch = (tid % row_threads) * 4, my_row = tid / row_threads;
  const int my_cg = F == KvFormat::kInt4 ? ch / kInt4ValueGroup : 0;
  float acc[G][4], m_run[G], l_run[G], mins[G][kMaxChannelGroups];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m_run[g] = -INFINITY;
    l_run[g] = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[g][k] = 0.f;
#pragma unroll
    for (int cg = 0; cg < kMaxChannelGroups; ++cg) mins[g][cg] = 0.f;
  }
  __syncthreads();

  for (int u = first; u < last; ++u) {
    const bool resid = u == coded;
    const int begin = resid ? resid_begin : groups.Begin(u);
    const int end = resid ? seq.len : min(groups.End(u), resid_begin);
    const int n = end - begin;  // 1 .. kThreads
    if (!resid) {               // fold the group's parameters into the queries
      const uint8_t* params = coding.k_params + KeyParamsAt(coding, d, c, u);
      for (int e = tid; e < G * d; e += kThreads) {
        const int g = e / d, i = e % d;
        sh.fold.qb[g][i] = sh.fold.q[g][i] * F16ToFloat(GetU16(params + 4 * i + 2));
      }
      for (int g = warp; g < G; g += kWarps) {
        float dot = 0.f;
        for (int i = lane; i < d; i += 32)
          dot += sh.fold.q[g][i] * F16ToFloat(GetU16(params + 4 * i));
        dot = WarpSum(dot);
        if (lane == 0) sh.qa[g] = dot;
      }
    }
    __syncthreads();

    // Scores, a token per thread, and its row's value scale and minimum.
    float s[G], row_scale[kMaxChannelGroups], row_min[kMaxChannelGroups];
#pragma unroll
    for (int cg = 0; cg < kMaxChannelGroups; ++cg) {
      row_scale[cg] = 1.f;
      row_min[cg] = 0.f;
    }
    if (tid < n) {
      const int t = begin + tid;
      if (resid) {
        const T* row = static_cast<const T*>(coding.k_resid) +
                       (int64_t{c} * coding.resid_tokens + (t - resid_begin)) * d;
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.f;
        for (int i = 0; i < d; ++i) {
          const float x = ToF32(row[i]);
#pragma unroll
          for (int g = 0; g < G; ++g) s[g] = fmaf(sh.fold.q[g][i], x, s[g]);
        }
      } else {
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.f;
        KeyDots<F, G>(keys + seq.layout.Row(c, t, kc), d, sh.fold.qb, s);
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] += sh.qa[g];
        const uint8_t* vrow = values + coding.v_layout.Row(c, t, vc);
        if constexpr (F == KvFormat::kInt8) {
          row_scale[0] = Bf16ToFloat(GetU16(vrow + d));
        } else if constexpr (F == KvFormat::kInt4) {
#pragma unroll
          for (int cg = 0; cg < kMaxChannelGroups; ++cg) {
            if (cg < channel_groups) {
              row_scale[cg] = F16ToFloat(GetU16(vrow + d / 2 + 4 * cg));
              row_min[cg] = F16ToFloat(GetU16(vrow + d / 2 + 4 * cg + 2));
            }
          }
        } else {
          row_scale[0] = E8M0ToFloat(coding.v_scales[int64_t{c} * coding.max_groups + u]);
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] *= scale;
    } else {
#pragma unroll
      for (int g = 0; g < G; ++g) s[g] = -INFINITY;
    }

    // The unit's online softmax: its maximum over the block, the running state rescaled.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mx = WarpMax(s[g]);
      if (lane == 0) sh.red_max[warp][g] = mx;
    }
    __syncthreads();
    float corr[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float unit_max = sh.red_max[0][g];
      for (int w = 1; w < kWarps; ++w) unit_max = fmaxf(unit_max, sh.red_max[w][g]);
      const float m_new = fmaxf(m_run[g], unit_max);
      corr[g] = m_run[g] == -INFINITY ? 0.f : __expf(m_run[g] - m_new);
      const float p = tid < n ? __expf(s[g] - m_new) : 0.f;
      const float sum = WarpSum(p);
      if (lane == 0) sh.red_sum[warp][g] = sum;
#pragma unroll
      for (int cg = 0; cg < kMaxChannelGroups; ++cg) {
        if (cg < channel_groups) {
          sh.w[g][cg][tid] = p * row_scale[cg];
          mins[g][cg] = mins[g][cg] * corr[g] + p * row_min[cg];
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[g][k] *= corr[g];
      m_run[g] = m_new;
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int w = 0; w < kWarps; ++w) sum += sh.red_sum[w][g];
      l_run[g] = l_run[g] * corr[g] + sum;
    }

    // Values: each row of threads takes every rows-th token.
    for (int j = my_row; j < n; j += rows) {
      const int t = begin + j;
      float x[4];
      if (resid) {
        const T* row = static_cast<const T*>(coding.v_resid) +
                       (int64_t{c} * coding.resid_tokens + (t - resid_begin)) * d + ch;
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = ToF32(row[k]);
      } else {
        ValueCodes<F>(values + coding.v_layout.Row(c, t, vc), ch, x);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float wt = sh.w[g][my_cg][j];
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[g][k] = fmaf(wt, x[k], acc[g][k]);
      }
    }
  }

  // The rows of threads' sums and int4's minimums over the block, then the outputs.
  __syncthreads();  // (the sums take the fold's space)
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int cg = 0; cg < kMaxChannelGroups; ++cg) {
      const float m = WarpSum(mins[g][cg]);
      if (lane == 0) sh.red_min[warp][g][cg] = m;
    }
    // One 16-byte store a thread (four 4-byte ones, a thread's 4 floats apart, would conflict).
    *reinterpret_cast<float4*>(&sh.acc[(my_row * G + g) * d + ch]) =
        make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
  }
  __syncthreads();
  const int64_t head0 = int64_t{b} * n_heads + int64_t{c} * G;  // item of query head c·G
  for (int e = tid; e < G * d; e += kThreads) {
    const int g = e / d, i = e % d;
    const int cg = F == KvFormat::kInt4 ? i / kInt4ValueGroup : 0;
    float total = 0.f;
    for (int r = 0; r < rows; ++r) total += sh.acc[(r * G + g) * d + i];
    for (int w = 0; w < kWarps; ++w) total += sh.red_min[w][g][cg];
    float l = 0.f;
#pragma unroll
    for (int x = 0; x < G; ++x) l = x == g ? l_run[x] : l;
    if (chunks == 1) {
      seq.out[(int64_t{c} * G + g) * d + i] = total / l;
    } else {
      part_acc[((head0 + g) * chunks + blockIdx.y) * d + i] = total;
    }
  }
  if (chunks > 1 && tid == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      part_m[(head0 + g) * chunks + blockIdx.y] = m_run[g];
      part_l[(head0 + g) * chunks + blockIdx.y] = l_run[g];
    }
  }
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads)
    CodedDecodeKernel(const DecodeSequence* __restrict__ seqs, int n_cache_heads, int d,
                      float scale, int chunks, int units_per_chunk, float* part_m, float* part_l,
                      float* part_acc) {
  __shared__ SharedState<G> sh;
  const int b = static_cast<int>(blockIdx.x / n_cache_heads);
  const int c = static_cast<int>(blockIdx.x % n_cache_heads);
  const DecodeSequence& seq = seqs[b];
  const int n_heads = n_cache_heads * G;
  // One format per sequence (a batch may mix them): the branch is the block's, not a thread's.
  switch (seq.coding.format) {
    case KvFormat::kFP8:
      AttendCoded<T, G, KvFormat::kFP8>(sh, seq, b, c, d, n_heads, scale, chunks, units_per_chunk,
                                        part_m, part_l, part_acc);
      return;
    case KvFormat::kInt8:
      AttendCoded<T, G, KvFormat::kInt8>(sh, seq, b, c, d, n_heads, scale, chunks, units_per_chunk,
                                         part_m, part_l, part_acc);
      return;
    default:
      AttendCoded<T, G, KvFormat::kInt4>(sh, seq, b, c, d, n_heads, scale, chunks, units_per_chunk,
                                         part_m, part_l, part_acc);
      return;
  }
}

}  // namespace kvwire::kernels::cuda::coded_decode
