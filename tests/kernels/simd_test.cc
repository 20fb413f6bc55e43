// The vector exp and the softmax sums built on it: the 16-lane path must give what the 8-lane
// one gives, bit for bit, because the selections and attention outputs are specified (and
// tested elsewhere) against row-at-a-time code that uses the 8-lane arithmetic.
#include "kernels/simd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace kvwire::kernels::simd {
namespace {

#if KVWIRE_AVX2
uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

#if defined(__AVX512F__)
// Inputs across the whole range exp sees in a softmax (x - max ≤ 0, and above 0 for the
// tests' sake), the clamps' edges and one ulp either side, and the special values.
std::vector<float> ExpInputs() {
  std::vector<float> x;
  for (float v = -120.f; v < 100.f; v += 0.0173f) x.push_back(v);
  const float inf = std::numeric_limits<float>::infinity();
  for (float edge : {-87.3365478515625f, 88.3762626647949f, 0.f, -0.f, 1e-30f, -1e-30f}) {
    x.push_back(edge);
    x.push_back(std::nextafter(edge, inf));
    x.push_back(std::nextafter(edge, -inf));
  }
  x.push_back(inf);
  x.push_back(-inf);
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  x.push_back(std::numeric_limits<float>::denorm_min());
  while (x.size() % 16 != 0) x.push_back(-1.f);
  return x;
}
#endif

TEST(Simd, Exp16EqualsExp8LaneForLane) {
#if !defined(__AVX512F__)
  GTEST_SKIP() << "built without AVX-512: Exp16 is not compiled in";
#else
  const std::vector<float> x = ExpInputs();
  for (size_t i = 0; i < x.size(); i += 16) {
    float wide[16], narrow[16];
    _mm512_storeu_ps(wide, Exp16(_mm512_loadu_ps(x.data() + i)));
    _mm256_storeu_ps(narrow, Exp8(_mm256_loadu_ps(x.data() + i)));
    _mm256_storeu_ps(narrow + 8, Exp8(_mm256_loadu_ps(x.data() + i + 8)));
    for (int l = 0; l < 16; ++l) {
      ASSERT_EQ(Bits(wide[l]), Bits(narrow[l])) << "exp(" << x[i + l] << ")";
    }
  }
  // And it is an exp: within the stated 2e-7 relative of libm where the result is normal.
  for (float v : {-80.f, -10.f, -1.f, -0.5f, 0.f, 0.25f, 3.f}) {
    float out[16];
    _mm512_storeu_ps(out, Exp16(_mm512_set1_ps(v)));
    EXPECT_NEAR(out[0], std::exp(v), 3e-7 * std::exp(v)) << v;
  }
#endif
}

// ExpShiftSum as it was written for 8 lanes: one vector of 8 after another, their exps added
// into one 8-lane accumulator in order, then the tail one by one.
float ExpShiftSum8(float* x, int n, float shift) {
  int i = 0;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = HorizontalSum(acc);
  for (; i < n; ++i) sum += x[i] = std::exp(x[i] - shift);
  return sum;
}

TEST(Simd, ExpShiftSumAndItsRowsEqualTheEightLaneLoop) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 6.f);
  for (int n : {1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 100, 3284}) {
    for (int rows : {1, 3, 4, 8, 12}) {
      const int stride = n + 5;
      std::vector<float> x(static_cast<size_t>(rows) * stride), shift(rows);
      for (float& v : x) v = normal(rng);
      for (int j = 0; j < rows; ++j) shift[j] = normal(rng);
      std::vector<float> want = x, one = x, got = x, sums(rows);
      ExpShiftSumRows(got.data(), stride, rows, n, shift.data(), sums.data());
      for (int j = 0; j < rows; ++j) {
        const float sum8 = ExpShiftSum8(want.data() + static_cast<size_t>(j) * stride, n, shift[j]);
        const float sum1 = ExpShiftSum(one.data() + static_cast<size_t>(j) * stride, n, shift[j]);
        ASSERT_EQ(Bits(sum1), Bits(sum8)) << "n " << n << " row " << j;
        ASSERT_EQ(Bits(sums[j]), Bits(sum8)) << "n " << n << " rows " << rows << " row " << j;
      }
      for (size_t e = 0; e < x.size(); ++e) {
        ASSERT_EQ(Bits(one[e]), Bits(want[e])) << "n " << n << " element " << e;
        ASSERT_EQ(Bits(got[e]), Bits(want[e])) << "n " << n << " rows " << rows << " element " << e;
      }
    }
  }
}
#endif

}  // namespace
}  // namespace kvwire::kernels::simd
