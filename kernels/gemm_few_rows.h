// Matrix products with few activation rows: a decode batch, a short prompt. Internal to the
// CPU backend (kernels/cpu_backend.cc), which splits the weight rows between its threads.
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

}  // namespace kvwire::kernels
