// Small vector helpers for the CPU backend: dot products and AXPY over float32, bfloat16
// and float16 rows, with AVX2/FMA paths when the compiler targets them and plain loops
// otherwise (the plain loops are also what the reference backend does).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/base/dtype.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVWIRE_AVX2 1
#endif

namespace kvwire::kernels::simd {

#if KVWIRE_AVX2
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p, DType t) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (t == DType::kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// 8 floats of a row of dtype T from element i, T fixed at compile time so inner loops carry
// no dtype branch (bf16 is the top half of a float32).
template <DType T>
inline __m256 LoadAs8(const void* row, int64_t i) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  } else {
    return Load8(static_cast<const uint16_t*>(row) + i, T);
  }
}
#if defined(__AVX512F__)
// 16 floats of a row of dtype T from element i, as LoadAs8 does 8.
template <DType T>
inline __m512 LoadAs16(const void* row, int64_t i) {
  if constexpr (T == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(row) + i);
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
    if constexpr (T == DType::kF16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}
#endif
// Rows r[0..8) of 8 floats become the columns.
inline void Transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
inline float HorizontalSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

inline float LoadScalar(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.f;
}

// Σ a[i] · b[i] for float32 a and b of dtype t.
inline float Dot(const float* a, const void* b, DType t, int n) {
  int i = 0;
  float acc = 0.f;
#if KVWIRE_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  if (t == DType::kF32) {
    const float* bf = static_cast<const float*>(b);
    for (; i + 16 <= n; i += 16) {
      s0 = _mm256_fmadd_ps(Load8(a + i), Load8(bf + i), s0);
      s1 = _mm256_fmadd_ps(Load8(a + i + 8), Load8(bf + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(Load8(a + i), Load8(bf + i), s0);
  } else {
    const uint16_t* bh = static_cast<const uint16_t*>(b);
    for (; i + 16 <= n; i += 16) {
      s0 = _mm256_fmadd_ps(Load8(a + i), Load8(bh + i, t), s0);
      s1 = _mm256_fmadd_ps(Load8(a + i + 8), Load8(bh + i + 8, t), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(Load8(a + i), Load8(bh + i, t), s0);
  }
  acc = HorizontalSum(_mm256_add_ps(s0, s1));
#endif
  for (; i < n; ++i) acc += a[i] * LoadScalar(b, t, i);
  return acc;
}

// y[i] += alpha · x[i] for x of dtype t.
inline void Axpy(float alpha, const void* x, DType t, float* y, int n) {
  int i = 0;
#if KVWIRE_AVX2
  const __m256 va = _mm256_set1_ps(alpha);
  if (t == DType::kF32) {
    const float* xf = static_cast<const float*>(x);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, Load8(xf + i), Load8(y + i)));
    }
  } else {
    const uint16_t* xh = static_cast<const uint16_t*>(x);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, Load8(xh + i, t), Load8(y + i)));
    }
  }
#endif
  for (; i < n; ++i) y[i] += alpha * LoadScalar(x, t, i);
}

#if KVWIRE_AVX2
// exp(x) for 8 floats: x = n·ln2 + r with |r| ≤ ln2/2, e^r by a degree-6 polynomial
// (Cephes' expf coefficients), 2^n built in the exponent bits. Relative error ~2e-7;
// inputs below -87 flush to 0, as softmax wants for scores far under the maximum.
inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  // The clamps take x second: min and max return their second operand where either is NaN,
  // so a NaN stays NaN (as std::exp's) rather than becoming exp(88).
  x = _mm256_min_ps(hi, x);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#if defined(__AVX512F__)
// Exp8 on 16 floats: lane for lane the same operations (each exact per lane, or rounded once as
// there), so the same results; half the instructions per element. The zero-masked forms with
// every lane set are the plain operations; GCC 12's plain forms start from an "undefined"
// vector that its -Wmaybe-uninitialized then reports wherever they are inlined (GCC bug
// 105593).
constexpr __mmask16 kAll16 = 0xFFFF;
inline __m512 Exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365478515625f);
  x = _mm512_maskz_min_ps(kAll16, hi, x);  // x second, as in Exp8
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_maskz_max_ps(kAll16, lo, x);
  const __m512 n =
      _mm512_maskz_roundscale_ps(kAll16, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_maskz_slli_epi32(
      kAll16, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll16, n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow),
                             _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// acc + the low 8 lanes of v, then + the high 8: the adds of two 8-lane steps, in order.
inline __m256 AddHalves(__m256 acc, __m512 v) {
  const __m512d d = _mm512_castps_pd(v);
  acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, d, 0)));
  return _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, d, 1)));
}
#endif

#if KVWIRE_AVX2
inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
#endif

// max over x[0..n), n ≥ 1.
inline float Max(const float* x, int n) {
  int i = 0;
  float mx = x[0];
#if KVWIRE_AVX2
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    mx = HorizontalMax(v);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// x[i] = exp(x[i] - shift); returns Σ x[i] (after the exp).
inline float ExpShiftSum(float* x, int n, float shift) {
  int i = 0;
  float sum = 0.f;
#if KVWIRE_AVX2
  const __m256 vs = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
#if defined(__AVX512F__)
  const __m512 ws = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), ws));
    _mm512_storeu_ps(x + i, e);
    acc = AddHalves(acc, e);
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = HorizontalSum(acc);
#endif
  for (; i < n; ++i) sum += x[i] = std::exp(x[i] - shift);
  return sum;
}

// ExpShiftSum of `rows` rows at once (row j: x + j·stride, shifted by shift[j], its sum in
// sums[j]), each row's exps and sum bit for bit ExpShiftSum's: the same vectors and the same
// order of adds per row. Up to eight rows go through each vector pass together, so their
// add chains overlap instead of one row's chain setting the pace.
inline void ExpShiftSumRows(float* x, int64_t stride, int rows, int n, const float* shift,
                            float* sums) {
  for (int j0 = 0; j0 < rows; j0 += 8) {
    const int nr = std::min(8, rows - j0);
    int i = 0;
#if KVWIRE_AVX2
    __m256 vs[8], acc[8];
    for (int j = 0; j < nr; ++j) {
      vs[j] = _mm256_set1_ps(shift[j0 + j]);
      acc[j] = _mm256_setzero_ps();
    }
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
      for (int j = 0; j < nr; ++j) {
        float* xj = x + (j0 + j) * stride + i;
        const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(xj), _mm512_set1_ps(shift[j0 + j])));
        _mm512_storeu_ps(xj, e);
        acc[j] = AddHalves(acc[j], e);
      }
    }
#endif
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < nr; ++j) {
        float* xj = x + (j0 + j) * stride + i;
        const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(xj), vs[j]));
        _mm256_storeu_ps(xj, e);
        acc[j] = _mm256_add_ps(acc[j], e);
      }
    }
    for (int j = 0; j < nr; ++j) sums[j0 + j] = HorizontalSum(acc[j]);
#else
    for (int j = 0; j < nr; ++j) sums[j0 + j] = 0.f;
#endif
    for (int j = 0; j < nr; ++j) {
      float* xj = x + (j0 + j) * stride;
      const float sh = shift[j0 + j];
      for (int t = i; t < n; ++t) sums[j0 + j] += xj[t] = std::exp(xj[t] - sh);
    }
  }
}

// Pointer to element i of a row of dtype t.
inline const void* Offset(const void* base, DType t, int64_t i) {
  return static_cast<const char*>(base) + i * static_cast<int64_t>(DTypeSize(t));
}

}  // namespace kvwire::kernels::simd
