#include "kernels/gemm_few_rows.h"

#include "kernels/simd.h"

// GCC 12's AVX-512 intrinsics initialise their "undefined" vectors from themselves, which
// its own -Wuninitialized then reports where they are inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kvwire::kernels {
namespace {

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
    if constexpr (T == DType::kF32) {
      return _mm512_loadu_ps(static_cast<const float*>(row) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
      if constexpr (T == DType::kF16) {
        return _mm512_cvtph_ps(h);
      } else {
        // bf16 is the top half of a float32.
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
    }
  }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(V v) { return _mm512_reduce_add_ps(v); }
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
    if constexpr (T == DType::kF32) {
      return _mm256_loadu_ps(static_cast<const float*>(row) + i);
    } else {
      return simd::Load8(static_cast<const uint16_t*>(row) + i, T);
    }
  }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(V v) { return simd::HorizontalSum(v); }
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
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NC; ++c) acc[r][c] = Isa::Zero();
  }
  for (; i + Isa::kLanes <= k; i += Isa::kLanes) {
    typename Isa::V wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = Isa::template LoadW<T>(rows[c], i);
    for (int r = 0; r < MR; ++r) {
      const typename Isa::V xv = Isa::LoadX(x + r * xs + i);
      for (int c = 0; c < NC; ++c) acc[r][c] = Isa::Fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NC; ++c) sums[r][c] = Isa::Sum(acc[r][c]);
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

}  // namespace

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
