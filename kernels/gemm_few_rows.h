// Register-tiled matrix products of the CPU backend: few float32 activation rows (a decode
// batch, a short prompt) against f32/bf16/f16 weights, and bf16 dot products over panels of
// rows for bf16 weights. Internal to kernels/cpu_backend.cc, which splits the weight rows
// between its threads.
#pragma once

#include <cstdint>

#include "common/base/dtype.h"

namespace kvwire::kernels {

// The most activation rows GemmFewRows is used for; more go to OpenBLAS (cpu_backend.cc),
// whose cache blocking wins once the weights are reused enough to be compute-bound.
inline constexpr int kFewRowsMax = 64;

// y[r·ys + j] = Σ_i x[r·xs + i] · W[j·k + i] (+ bias[j]) for r < m and j0 ≤ j < j1, W of dtype
// wt (f32, bf16 or f16) widened in registers; float32 accumulation.
//
// Register tiles of 4 weight rows × up to 4 activation rows: each tile of W is read from
// memory once and then from cache for every further block of activation rows, so memory
// traffic is one pass over W whatever m is (a decode step is bound by that pass, a short
// prompt by the multiply-adds). AVX-512 when the compiler targets it, else AVX2/FMA, else
// plain loops.
void GemmFewRows(const float* x, int64_t xs, int m, const void* w, DType wt, int k, int64_t j0,
                 int64_t j1, const float* bias, float* y, int64_t ys);

// bf16 weights multiply x rounded to bf16 (to nearest even): each product is exact in
// float32 and the sums are float32, as on tensor cores (and in llama.cpp). With AVX-512 BF16
// (Zen 4, Sapphire Rapids) that is _mm512_dpbf16_ps, twice the multiply-adds per instruction
// of float32 FMA, and half the bytes of x to keep in cache.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVWIRE_BF16_DOT 1
inline constexpr bool kHasBf16Dot = true;
#else
inline constexpr bool kHasBf16Dot = false;
#endif

// Rows of x rounded to bf16 into `out`, rows of kp ≥ k elements, zero past k.
void RoundToBf16(const float* x, int64_t xs, int m, int k, uint16_t* out, int64_t kp);

// y[r·ys + j] = Σ_i xb[r·kp + i] · W[j·k + i] (+ bias[j]) for r < m and j0 ≤ j < j1: xb from
// RoundToBf16 with kp a multiple of 32, W bf16. Register tiles as GemmFewRows, each prefetching
// the next tile of W into L2 while it computes; m is best a panel whose xb stays in the core's
// L2 (cpu_backend.cc). One row of x (decode at batch 1) reads W a row at a time instead, one
// sequential stream, which on Zen 4 reads faster than several rows interleaved.
//
// Over elements [i0, i1) of the rows only (i0 a multiple of 32): from i0 = 0, y gets the sums
// plus the bias, after that the sums are added to y. A product with long rows goes stretch by
// stretch (Bf16Stretch) over a panel of x rows sized by the stretch, so that the panel's
// stretch stays in L2 and each tile of W in L1 while it is used.
void GemmBf16(const uint16_t* xb, int64_t kp, int m, const uint16_t* w, int k, int i0, int i1,
              int64_t j0, int64_t j1, const float* bias, float* y, int64_t ys);

// Rows of x GemmBf16 takes in one pass over a tile of W (register tiles of 6 x rows × 4 W
// rows: 24 accumulators, 4 vectors of W and one of x in AVX-512's 32 registers).
inline constexpr int kBf16PassRows = 6;

// Elements of a row GemmBf16 is best given at a time for m rows of x: whole rows for one row
// (a decode step streams W row by row) and up to 4096, else stretches of about 2048 (a multiple
// of 32).
int Bf16Stretch(int m, int k);

}  // namespace kvwire::kernels
