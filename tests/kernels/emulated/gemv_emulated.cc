// kernels/cuda/matmul.cuh (MatMul's decode-sized GEMV: a warp per 1, 2 or 4 rows of W, 16-byte
// loads of W and, where x's rows are aligned, of x; against bf16 W of more than one row, x's rows
// rounded first by RoundRowsKernel) run where no GPU is, on emulated blocks, against the
// reference's MatMul: each dtype, each kernel built for a number of rows (1, 2, 4, 8, 16) and fewer
// rows than it is built for, W and x rows that allow 16-byte loads and ones that do not (a row
// length off the vector, a stride off 16 bytes, W one element past an aligned address), the loop's
// unrolled steps and its remainder, bias, strided y. No vector load may be misaligned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "emulated_block.h"
#include "kernels/backend.h"
#include "kernels/cuda/matmul.cuh"  // over the stand-in cuda_util.cuh
#include "tests/kernels/ops_test_util.h"

namespace kvwire {
namespace {

namespace gv = kernels::cuda::decode_gemv;
using kernels::MatMulParams;

// As matmul.cu's LaunchGemv, from the same plan (PlanGemv): bf16 W and more than one row of x,
// the rows rounded first (into `scratch`, 16-byte aligned as a device allocation is).
absl::Status Emulate(const MatMulParams& p, emulated::Order order) {
  const int64_t xs = p.x_stride ? p.x_stride : p.k, ys = p.y_stride ? p.y_stride : p.n;
  std::vector<float4> scratch(gv::GemvScratchBytes(p) / sizeof(float4) + 1);
  return kernels::cuda::DispatchDType(p.w_dtype, [&]<typename T>() {
    return gv::DispatchRows(p.m, [&]<int M>() {
      const gv::GemvPlan g = gv::PlanGemv<M>(p, xs, scratch.data(), sizeof(T));
      const T* w = static_cast<const T*>(p.w);
      auto run = [&]<bool kRoundX>() {
        return emulated::RunGrid({static_cast<unsigned>(g.blocks), 1, 1}, g.threads, order, [&] {
          if (g.vec) {
            gv::GemvKernel<T, M, true, kRoundX>(g.x, g.xs, g.x_vec, w, p.bias, p.y, ys, p.m, p.n,
                                                p.k);
          } else {
            gv::GemvKernel<T, M, false, kRoundX>(g.x, g.xs, false, w, p.bias, p.y, ys, p.m, p.n,
                                                 p.k);
          }
        });
      };
      if (!g.round_first) {
        return run.template operator()<true>() ? absl::OkStatus()
                                               : absl::InternalError("the threads deadlocked");
      }
      const int64_t total = static_cast<int64_t>(p.m) * p.k;
      auto* rounded = reinterpret_cast<float*>(scratch.data());
      if (!emulated::RunGrid({static_cast<unsigned>((total + 255) / 256), 1, 1}, 256, order,
                             [&] { gv::RoundRowsKernel(p.x, xs, rounded, p.m, p.k); })) {
        return absl::InternalError("the rounding block's threads deadlocked");
      }
      return run.template operator()<false>() ? absl::OkStatus()
                                              : absl::InternalError("the threads deadlocked");
    });
  });
}

struct Case {
  int m, n, k;
  int x_pad, y_pad;
  bool w_offset;  // W one element past a 16-byte boundary
  bool bias;
};

TEST(GemvEmulated, EqualsTheReference) {
  const Case cases[] = {
      {1, 37, 2112, 0, 0, false, false},  // bf16/f16: 8 steps unrolled by 4, then 0; f32: 16+...
      {1, 9, 2080, 4, 3, false, true},    // a remainder after the unrolled steps
      {2, 20, 520, 0, 0, false, true},
      {3, 17, 1024, 1, 0, false, false},  // x off 16 bytes
      {4, 8, 768, 0, 2, true, true},      // W off 16 bytes: one element a lane
      {5, 12, 130, 0, 0, false, false},   // k off the vector (bf16, f16 and f32)
      {8, 33, 1056, 4, 1, false, true},
      {11, 16, 512, 0, 0, false, true},
      // A warp's 2 or 4 rows of W cut short by n (1 of 2; 2 and 3 of 4), off the vector, strided.
      {2, 21, 1040, 1, 3, false, true},
      {2, 19, 130, 0, 2, true, true},
      {4, 30, 768, 0, 1, false, true},
      {8, 35, 520, 0, 0, false, true},
      {16, 9, 4096, 8, 0, false, false},
      {16, 5, 60, 0, 0, false, true},
  };
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  ASSERT_TRUE(reference.ok());
  uint32_t seed = 1;
  int run = 0;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(DTypeName(t), " m=", c.m, " n=", c.n, " k=", c.k,
                                " x_pad=", c.x_pad, " y_pad=", c.y_pad, " w_offset=", c.w_offset));
      const int64_t xs = c.k + c.x_pad, ys = c.n + c.y_pad;
      // x and W in 16-byte aligned buffers (vectors of float4's size), W shifted where asked.
      std::vector<float4> x_buf((c.m * xs + 3) / 4 + 1);
      float* x = reinterpret_cast<float*>(x_buf.data());
      const std::vector<float> xf = kernels::Random(static_cast<size_t>(c.m) * xs, seed++);
      std::copy(xf.begin(), xf.end(), x);
      const std::vector<uint8_t> w =
          kernels::Encode(kernels::Random(static_cast<size_t>(c.n) * c.k, seed++), t);
      const size_t shift = c.w_offset ? DTypeSize(t) : 0;
      std::vector<float4> w_buf((w.size() + shift) / 16 + 1);
      uint8_t* wp = reinterpret_cast<uint8_t*>(w_buf.data()) + shift;
      std::memcpy(wp, w.data(), w.size());
      const std::vector<float> bias = kernels::Random(c.n, seed++);
      MatMulParams p;
      p.m = c.m;
      p.n = c.n;
      p.k = c.k;
      p.x = x;
      p.x_stride = xs;
      p.w = wp;
      p.w_dtype = t;
      p.bias = c.bias ? bias.data() : nullptr;
      p.y_stride = ys;
      std::vector<float> want(static_cast<size_t>(c.m) * ys, 0.f), got(want.size(), 0.f);
      // Rows of y the product writes start as NaN: one left unwritten fails.
      for (int r = 0; r < c.m; ++r) std::fill_n(got.begin() + r * ys, c.n, std::nanf(""));
      p.y = want.data();
      ASSERT_TRUE((*reference)->MatMul(p).ok());
      p.y = got.data();
      const int64_t misaligned = emulated::misaligned;
      const absl::Status st = Emulate(p, emulated::kOrders[run++ % std::size(emulated::kOrders)]);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(emulated::misaligned, misaligned) << "misaligned vector loads";
      // As BackendOpsTest.MatMul: float32 sums in another order than the reference's.
      EXPECT_TRUE(kernels::AllClose(got, want, {1e-5f * std::max(1.f, c.k / 512.f), 2e-4f}));
    }
  }
}

}  // namespace
}  // namespace kvwire
