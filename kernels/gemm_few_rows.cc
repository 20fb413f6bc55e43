#include "kernels/gemm_few_rows.h"

#include <algorithm>

#include "kernels/simd.h"

// GCC 12's AVX-512 intrinsics initialise their "undefined" vectors from themselves, which
// its own -Wuninitialized then reports where they are inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kvwire::kernels {
namespace {

#if KVWIRE_AVX2
// [Σa, Σb, Σc, Σd] of four 8-float vectors: pairwise adds within each 128-bit lane, then
// the two lanes added.
inline __m128 Avx2Sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// The vector width the compiler targets. kRows × kCols is the register tile: kRows·kCols
// accumulators, kCols widened weight vectors and one activation vector live at once
// (32 registers with AVX-512, 16 with AVX2).
#if defined(__AVX512F__)
struct Isa {
  using V = __m512;
  static constexpr int kLanes = 16, kRows = 4, kCols = 4;
  static V Zero() { return _mm512_setzero_ps(); }
  static V LoadX(const float* p) { return _mm512_loadu_ps(p); }
  template <DType T>
  static V LoadW(const void* row, int64_t i) {
    return simd::LoadAs16<T>(row, i);
  }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(V v) { return _mm512_reduce_add_ps(v); }
  // The four sums of a..d at once (a quarter of the shuffles of four Sum calls, which
  // matters where k is small: a tiny model's rows are a few vectors long).
  static __m128 Sum4(V a, V b, V c, V d) { return Avx2Sum4(Half(a), Half(b), Half(c), Half(d)); }
  static __m256 Half(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};
#define KVWIRE_GEMM_VECTOR 1
#elif KVWIRE_AVX2
struct Isa {
  using V = __m256;
  static constexpr int kLanes = 8, kRows = 2, kCols = 4;
  static V Zero() { return _mm256_setzero_ps(); }
  static V LoadX(const float* p) { return _mm256_loadu_ps(p); }
  template <DType T>
  static V LoadW(const void* row, int64_t i) {
    return simd::LoadAs8<T>(row, i);
  }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(V v) { return simd::HorizontalSum(v); }
  static __m128 Sum4(V a, V b, V c, V d) { return Avx2Sum4(a, b, c, d); }
};
#define KVWIRE_GEMM_VECTOR 1
#else
struct Isa {
  static constexpr int kRows = 4, kCols = 4;
};
#endif

// y[r, j + c] for r < MR, c < NC: one register tile over the whole of k.
template <DType T, int MR, int NC>
void Tile(const float* x, int64_t xs, const void* w, int k, int64_t j, const float* bias, float* y,
          int64_t ys) {
  const void* rows[NC];
  for (int c = 0; c < NC; ++c) rows[c] = simd::Offset(w, T, (j + c) * k);
  float sums[MR][NC];
  int i = 0;
#if KVWIRE_GEMM_VECTOR
  typename Isa::V acc[MR][NC];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = Isa::Zero();
  }
  for (; i + Isa::kLanes <= k; i += Isa::kLanes) {
    typename Isa::V wv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) wv[c] = Isa::template LoadW<T>(rows[c], i);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const typename Isa::V xv = Isa::LoadX(x + r * xs + i);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = Isa::Fma(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    if constexpr (NC == 4) {
      _mm_storeu_ps(sums[r], Isa::Sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int c = 0; c < NC; ++c) sums[r][c] = Isa::Sum(acc[r][c]);
    }
  }
#else
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NC; ++c) sums[r][c] = 0.f;
  }
#endif
  for (; i < k; ++i) {
    for (int c = 0; c < NC; ++c) {
      const float wv = simd::LoadScalar(rows[c], T, i);
      for (int r = 0; r < MR; ++r) sums[r][c] += x[r * xs + i] * wv;
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NC; ++c) y[r * ys + j + c] = sums[r][c] + (bias ? bias[j + c] : 0.f);
  }
}

// Every activation row against weight rows j .. j + NC: the tile of W comes from memory for
// the first block of rows and from cache after it.
template <DType T, int NC>
void AllRows(const float* x, int64_t xs, int m, const void* w, int k, int64_t j, const float* bias,
             float* y, int64_t ys) {
  constexpr int R = Isa::kRows;
  int r = 0;
  for (; r + R <= m; r += R) Tile<T, R, NC>(x + r * xs, xs, w, k, j, bias, y + r * ys, ys);
  const int left = m - r;
  x += r * xs;
  y += r * ys;
  if constexpr (R > 1) {
    if (left == 1) Tile<T, 1, NC>(x, xs, w, k, j, bias, y, ys);
  }
  if constexpr (R > 2) {
    if (left == 2) Tile<T, 2, NC>(x, xs, w, k, j, bias, y, ys);
  }
  if constexpr (R > 3) {
    if (left == 3) Tile<T, 3, NC>(x, xs, w, k, j, bias, y, ys);
  }
}

template <DType T>
void Gemm(const float* x, int64_t xs, int m, const void* w, int k, int64_t j0, int64_t j1,
          const float* bias, float* y, int64_t ys) {
  constexpr int C = Isa::kCols;
  int64_t j = j0;
  for (; j + C <= j1; j += C) AllRows<T, C>(x, xs, m, w, k, j, bias, y, ys);
  for (; j < j1; ++j) AllRows<T, 1>(x, xs, m, w, k, j, bias, y, ys);
}

#if KVWIRE_BF16_DOT
// One 32-element step of TileBf16: NC vectors of W (the last, partial one of a row a masked
// load), each multiplied with MR vectors of x.
template <int MR, int NC, int PF, bool kMasked>
[[gnu::always_inline]] inline void StepBf16(__m512 (&acc)[MR][NC],
                                            const uint16_t* const (&rows)[NC], const uint16_t* xb,
                                            int64_t kp, int i, __mmask32 mask,
                                            const uint16_t* prefetch, int k) {
#pragma GCC unroll 4
  for (int c = 0; c < PF; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * k + i), _MM_HINT_T1);
  }
  __m512bh wv[NC];
#pragma GCC unroll 4
  for (int c = 0; c < NC; ++c) {
    wv[c] = kMasked ? (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[c] + i)
                    : (__m512bh)_mm512_loadu_si512(rows[c] + i);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * kp + i);
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
  }
}

// y[r, j + c] for r < MR, c < NC from bf16 rows: _mm512_dpbf16_ps multiplies 32 pairs
// exactly and adds them into 16 float32 lanes. x rows are padded with zeros to a multiple
// of 32 (RoundToBf16); the last, partial vector of a W row is a masked load, outside the
// main loop.
//
// Over elements [i0, i1) of the rows only (a multiple of 32 apart, but for the row's end):
// from i0 = 0 y gets the sums plus the bias, after that the sums are added to it.
template <int MR, int NC, int PF = 0>
void TileBf16(const uint16_t* xb, int64_t kp, const uint16_t* w, int k, int i0, int i1, int64_t j,
              const float* bias, float* y, int64_t ys, const uint16_t* prefetch = nullptr) {
  const uint16_t* rows[NC];
  for (int c = 0; c < NC; ++c) rows[c] = w + (j + c) * k;
  __m512 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  // The loops over the tile are unrolled so the accumulators stay in registers.
  int i = i0;
  for (; i + 32 <= i1; i += 32) StepBf16<MR, NC, PF, false>(acc, rows, xb, kp, i, 0, prefetch, k);
  if (i < i1) {
    StepBf16<MR, NC, PF, true>(acc, rows, xb, kp, i, (__mmask32{1} << (i1 - i)) - 1, prefetch, k);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float sums[NC];
    if constexpr (NC == 4) {
      _mm_storeu_ps(sums, Isa::Sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int c = 0; c < NC; ++c) sums[c] = Isa::Sum(acc[r][c]);
    }
    for (int c = 0; c < NC; ++c) {
      float& out = y[r * ys + j + c];
      out = i0 == 0 ? sums[c] + (bias ? bias[j + c] : 0.f) : out + sums[c];
    }
  }
}

// One activation row (a decode step at batch 1): each weight row is read start to end
// before the next, one forward stream per thread, which reads W faster than four rows
// interleaved as TileBf16 reads them (docs/benchmarks.md, "Engine"). Two accumulators hide the
// instruction's latency.
void RowsBf16(const uint16_t* xb, const uint16_t* w, int k, int64_t j0, int64_t j1,
              const float* bias, float* y) {
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* row = w + j * k;
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= k; i += 64) {
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(xb + i),
                           (__m512bh)_mm512_loadu_si512(row + i));
      b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(xb + i + 32),
                           (__m512bh)_mm512_loadu_si512(row + i + 32));
    }
    // At most two vectors left, the last partial: masked loads of W (xb is zero-padded).
    for (; i < k; i += 32) {
      const __mmask32 mask = k - i >= 32 ? ~__mmask32{0} : (__mmask32{1} << (k - i)) - 1;
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(xb + i),
                           (__m512bh)_mm512_maskz_loadu_epi16(mask, row + i));
    }
    y[j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) + (bias ? bias[j] : 0.f);
  }
}

// MR rows of x against NC rows of W, prefetching PF rows of the next tile of W (at `prefetch`)
// into L2 as it goes.
template <int NC, int PF>
void PassBf16(int mr, const uint16_t* xb, int64_t kp, const uint16_t* w, int k, int i0, int i1,
              int64_t j, const float* bias, float* y, int64_t ys, const uint16_t* prefetch) {
  switch (mr) {
    case 1:
      return TileBf16<1, NC, PF>(xb, kp, w, k, i0, i1, j, bias, y, ys, prefetch);
    case 2:
      return TileBf16<2, NC, PF>(xb, kp, w, k, i0, i1, j, bias, y, ys, prefetch);
    case 3:
      return TileBf16<3, NC, PF>(xb, kp, w, k, i0, i1, j, bias, y, ys, prefetch);
    case 4:
      return TileBf16<4, NC, PF>(xb, kp, w, k, i0, i1, j, bias, y, ys, prefetch);
    case 5:
      return TileBf16<5, NC, PF>(xb, kp, w, k, i0, i1, j, bias, y, ys, prefetch);
    default:
      return TileBf16<6, NC, PF>(xb, kp, w, k, i0, i1, j, bias, y, ys, prefetch);
  }
}

// Every row of x against elements [i0, i1) of W rows j .. j + NC, in passes of up to
// kBf16PassRows x rows; the tile of W comes from memory in the first pass and from cache after it.
// The next tile (when it is in this task's range) is prefetched meanwhile, one row per pass where
// there are enough passes, else all in the first: without it each tile's first pass waits on
// memory, which for short prompts (a few passes a tile) was most of the time.
template <int NC>
void AllRowsBf16(const uint16_t* xb, int64_t kp, int m, const uint16_t* w, int k, int i0, int i1,
                 int64_t j, int64_t j1, const float* bias, float* y, int64_t ys) {
  const int passes = (m + kBf16PassRows - 1) / kBf16PassRows;
  const uint16_t* next = j + 2 * NC <= j1 ? w + (j + NC) * k : nullptr;
  for (int p = 0; p < passes; ++p) {
    const int r = kBf16PassRows * p, mr = std::min(kBf16PassRows, m - r);
    const uint16_t* x = xb + r * kp;
    float* yr = y + r * ys;
    if (next != nullptr && passes >= NC && p < NC) {
      PassBf16<NC, 1>(mr, x, kp, w, k, i0, i1, j, bias, yr, ys, next + p * k);
    } else if (next != nullptr && passes < NC && p == 0) {
      PassBf16<NC, NC>(mr, x, kp, w, k, i0, i1, j, bias, yr, ys, next);
    } else {
      PassBf16<NC, 0>(mr, x, kp, w, k, i0, i1, j, bias, yr, ys, nullptr);
    }
  }
}
#endif

}  // namespace

int Bf16Stretch(int m, int k) {
  if (m == 1 || k <= 4096) return k;
  const int stretches = (k + 2047) / 2048;
  return ((k + stretches - 1) / stretches + 31) / 32 * 32;
}

void RoundToBf16(const float* x, int64_t xs, int m, int k, uint16_t* out, int64_t kp) {
  for (int r = 0; r < m; ++r) {
    const float* xr = x + r * xs;
    uint16_t* o = out + r * kp;
    int i = 0;
#if KVWIRE_BF16_DOT
    // _mm512_cvtneps_pbh rounds to nearest even, as FloatToBf16 does.
    for (; i + 16 <= k; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + i)));
    }
#endif
    for (; i < k; ++i) o[i] = FloatToBf16(xr[i]);
    for (; i < kp; ++i) o[i] = 0;
  }
}

void GemmBf16(const uint16_t* xb, int64_t kp, int m, const uint16_t* w, int k, int i0, int i1,
              int64_t j0, int64_t j1, const float* bias, float* y, int64_t ys) {
#if KVWIRE_BF16_DOT
  if (m == 1 && i0 == 0 && i1 == k) return RowsBf16(xb, w, k, j0, j1, bias, y);
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) AllRowsBf16<4>(xb, kp, m, w, k, i0, i1, j, j1, bias, y, ys);
  for (; j < j1; ++j) AllRowsBf16<1>(xb, kp, m, w, k, i0, i1, j, j1, bias, y, ys);
#else
  // Without the instruction: the same products (exact in float32) widened.
  for (int r = 0; r < m; ++r) {
    for (int64_t j = j0; j < j1; ++j) {
      float acc = 0.f;
      for (int i = i0; i < i1; ++i) acc += Bf16ToFloat(xb[r * kp + i]) * Bf16ToFloat(w[j * k + i]);
      float& out = y[r * ys + j];
      out = i0 == 0 ? acc + (bias ? bias[j] : 0.f) : out + acc;
    }
  }
#endif
}

void GemmFewRows(const float* x, int64_t xs, int m, const void* w, DType wt, int k, int64_t j0,
                 int64_t j1, const float* bias, float* y, int64_t ys) {
  switch (wt) {
    case DType::kF32:
      return Gemm<DType::kF32>(x, xs, m, w, k, j0, j1, bias, y, ys);
    case DType::kBF16:
      return Gemm<DType::kBF16>(x, xs, m, w, k, j0, j1, bias, y, ys);
    case DType::kF16:
      return Gemm<DType::kF16>(x, xs, m, w, k, j0, j1, bias, y, ys);
  }
}

}  // namespace kvwire::kernels
