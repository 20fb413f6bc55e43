// The KV row formats: E4M3 against its definition code by code, each format's row size, and
// every format's reconstruction error within the bound its coding promises.
#include "common/base/kv_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

namespace kvwire {
namespace {

// E4M3 by its definition (sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent 0 is
// subnormal; S.1111.111 is NaN), written independently of the bit-level coder.
float E4M3ByDefinition(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  const double mag = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return static_cast<float>(s ? -mag : mag);
}

TEST(KvFormat, E4M3DecodesEveryCodeByDefinition) {
  for (int c = 0; c < 256; ++c) {
    const float want = E4M3ByDefinition(c);
    const float got = E4M3ToFloat(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      continue;
    }
    EXPECT_EQ(got, want) << "code " << c;
    // Every finite value codes back to itself (negative zero included).
    EXPECT_EQ(FloatToE4M3(got), c) << "code " << c;
  }
}

TEST(KvFormat, E4M3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(FloatToE4M3(1.0f), 0x38);
  EXPECT_EQ(FloatToE4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(1e6f), 0x7e);  // saturated, not NaN
  EXPECT_EQ(FloatToE4M3(-1e6f), 0xfe);
  EXPECT_EQ(FloatToE4M3(464.0f), 0x7e);  // between 448 and the (absent) 480: saturates
  EXPECT_EQ(FloatToE4M3(NAN), 0x7f);
  EXPECT_EQ(FloatToE4M3(1.0625f), 0x38);  // halfway between 1 and 1.125: to the even 1
  EXPECT_EQ(FloatToE4M3(1.1875f), 0x3a);  // halfway between 1.125 and 1.25: to the even 1.25
  EXPECT_EQ(FloatToE4M3(1.07f), 0x39);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -9)), 0x01);   // the smallest subnormal
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -10)), 0x00);  // half of it: ties to even zero
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(FloatToE4M3(std::ldexp(7.5f, -9)), 0x08);  // rounds up into the normals
  // The nearest code for every value on a fine grid: no code is closer than the one chosen.
  for (float x = -500; x <= 500; x += 0.0371f) {
    const float got = E4M3ToFloat(FloatToE4M3(x));
    if (std::fabs(x) >= 448) {
      EXPECT_EQ(std::fabs(got), 448.0f);
      continue;
    }
    for (int c = 0; c < 256; ++c) {
      const float other = E4M3ByDefinition(c);
      if (!std::isnan(other)) {
        ASSERT_LE(std::fabs(got - x), std::fabs(other - x)) << x << " coded " << got;
      }
    }
  }
}

TEST(KvFormat, Sizes) {
  // Value blocks: int8 and int4 rows carry their parameters; fp8 rows share a group's E8M0.
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kAuto, DType::kF32, 128, 10, 0, 10), 10u * 512);
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kAuto, DType::kBF16, 128, 10, 0, 10), 10u * 256);
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kBF16, DType::kF32, 128, 10, 0, 10), 10u * 256);
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kFP8, DType::kBF16, 128, 300, 0, 300), 300u * 128 + 4);
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kInt8, DType::kBF16, 128, 10, 0, 10), 10u * 130);
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kInt4, DType::kBF16, 128, 10, 0, 10), 10u * (64 + 4));
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kInt4, DType::kF32, 256, 10, 0, 10), 10u * (128 + 2 * 4));
  EXPECT_EQ(KvValueBlockBytes(KvFormat::kInt4, DType::kF32, 8, 10, 0, 10), 10u * (4 + 4));
  // Key blocks: codes, then per group the block touches two f16 per channel.
  EXPECT_EQ(KvKeyBlockBytes(KvFormat::kBF16, DType::kF32, 64, 300, 0, 300), 300u * 128);
  EXPECT_EQ(KvBlockGroups(KvFormat::kFP8, 300, 0, 300), 4);  // 128 + 128 + 28 + 16
  EXPECT_EQ(KvKeyBlockBytes(KvFormat::kFP8, DType::kBF16, 64, 300, 0, 300), 300u * 64 + 4 * 256);
  EXPECT_EQ(KvKeyBlockBytes(KvFormat::kInt4, DType::kBF16, 64, 300, 0, 300), 300u * 32 + 4 * 256);
  EXPECT_EQ(KvBlockGroups(KvFormat::kBF16, 300, 0, 300), 0);
  EXPECT_EQ(KvBlockGroups(KvFormat::kInt4, 300, 290, 10), 1);   // inside the recent group
  EXPECT_EQ(KvBlockGroups(KvFormat::kInt4, 300, 100, 100), 2);  // across groups 0 and 1
  EXPECT_EQ(KvBlockGroups(KvFormat::kInt4, 10, 0, 10), 1);
}

// The groups belong to the head: 128 tokens from its first, its last 16 kept tokens, then the
// appended tokens' groups of 128 from the first appended.
TEST(KvFormat, GroupsOfAHead) {
  const KvGroups g{300};
  EXPECT_EQ(g.recent(), 284);
  EXPECT_EQ(g.prompt_groups(), 4);
  for (auto [t, want] : std::vector<std::pair<int, int>>{{0, 0},
                                                         {127, 0},
                                                         {128, 1},
                                                         {255, 1},
                                                         {256, 2},
                                                         {283, 2},
                                                         {284, 3},
                                                         {299, 3},
                                                         {300, 4},
                                                         {427, 4},
                                                         {428, 5}}) {
    EXPECT_EQ(g.Of(t), want) << t;
  }
  for (auto [grp, b, e] : std::vector<std::tuple<int, int, int>>{{0, 0, 128},
                                                                 {1, 128, 256},
                                                                 {2, 256, 284},
                                                                 {3, 284, 300},
                                                                 {4, 300, 428},
                                                                 {5, 428, 556}}) {
    EXPECT_EQ(g.Begin(grp), b) << grp;
    EXPECT_EQ(g.End(grp), e) << grp;
  }
  EXPECT_EQ(KvGroups{10}.prompt_groups(), 1);  // all recent
  EXPECT_EQ(KvGroups{10}.Of(9), 0);
  EXPECT_EQ(KvGroups{10}.Of(10), 1);
  EXPECT_EQ(KvGroups{272}.Of(255), 1);  // 256 below the recent: two whole groups
  EXPECT_EQ(KvGroups{272}.Of(256), 2);
  EXPECT_EQ(KvGroups{272}.prompt_groups(), 3);
  EXPECT_EQ(KvGroups{0}.Of(5), 0);
  EXPECT_EQ(KvGroups{0}.End(0), 128);
  // Every token of a cache of `capacity` has a group below Max(capacity).
  for (int capacity : {1, 16, 17, 129, 300, 1000}) {
    for (int kept = 0; kept <= capacity; kept += std::max(1, capacity / 7)) {
      EXPECT_LT(KvGroups{kept}.Of(capacity - 1), KvGroups::Max(capacity)) << kept;
    }
  }
}

TEST(KvFormat, RefusesAnOddHeadForInt4) {
  EXPECT_TRUE(CheckKvFormat(KvFormat::kInt4, 64).ok());
  const absl::Status odd = CheckKvFormat(KvFormat::kInt4, 7);
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(odd.message().find("even head_dim"), absl::string_view::npos) << odd;
}

TEST(KvFormat, E8M0ScalesAreTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(E8M0ToFloat(127), 1.0f);
  EXPECT_EQ(E8M0Up(448.0f, 448.0f), 127);  // exactly 1
  EXPECT_EQ(E8M0Up(449.0f, 448.0f), 128);  // 2
  EXPECT_EQ(E8M0Up(224.0f, 448.0f), 126);  // 0.5
  EXPECT_EQ(E8M0Up(225.0f, 448.0f), 127);
  EXPECT_EQ(E8M0Up(0.0f, 448.0f), 0);
  EXPECT_EQ(E8M0Up(1e-40f, 448.0f), 0);  // below the range: the smallest scale
  EXPECT_EQ(E8M0Up(INFINITY, 448.0f), 254);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-30, 30);
  for (int i = 0; i < 10000; ++i) {
    const float v = std::ldexp(1.0f + std::fabs(u(rng)) / 30, static_cast<int>(u(rng)));
    const float s = E8M0ToFloat(E8M0Up(v, 448.0f));
    ASSERT_LE(v / s, 448.0f) << v;
    ASSERT_GT(v / s, 224.0f) << v;
  }
}

TEST(KvFormat, ParsesNamesAndRefusesOthers) {
  for (KvFormat f : kAllKvFormats) EXPECT_EQ(*ParseKvFormat(KvFormatName(f)), f);
  EXPECT_EQ(*ParseKvFormat("fp8_e4m3"), KvFormat::kFP8);
  const auto bad = ParseKvFormat("fp4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("auto, bf16, fp8, int8, int4"), absl::string_view::npos);
}

// Rows of several magnitudes, with channels as real keys have them: one an outlier, one large
// and slowly varying over tokens (a low RoPE frequency), the rest noise.
std::vector<float> Rows(int rows, int d, std::mt19937& rng) {
  std::normal_distribution<float> n(0, 1);
  std::vector<float> x(static_cast<size_t>(rows) * d);
  for (int r = 0; r < rows; ++r) {
    const float mag = std::ldexp(1.0f, r % 9 - 4);
    for (int i = 0; i < d; ++i) x[static_cast<size_t>(r) * d + i] = mag * n(rng);
    x[static_cast<size_t>(r) * d] *= 20;
    x[static_cast<size_t>(r) * d + 1] = 180 * std::cos(3e-4f * r);
  }
  return x;
}

// |x − decode(encode(x))| for each format: within half a code step, the step being what
// each format's parameters make it (a group's range per channel for keys, a row's for values).
TEST(KvFormat, KeysWithinHalfAStepOfTheirChannelsRange) {
  std::mt19937 rng(7);
  for (int d : {8, 64, 96, 256}) {
    for (int n : {1, 37, 300}) {
      const std::vector<float> x = Rows(n, d, rng);
      for (KvFormat f : kAllKvFormats) {
        SCOPED_TRACE(absl::StrCat(KvFormatName(f), " d=", d, " n=", n));
        const KvGroups groups{n};
        std::vector<uint8_t> coded(KvKeyBlockBytes(f, DType::kF32, d, n, 0, n));
        std::vector<float> back(x.size());
        EncodeKvKeys(f, DType::kF32, d, n, 0, n, x.data(), coded.data());
        DecodeKvKeys(f, DType::kF32, d, n, 0, n, coded.data(), back.data());
        for (int t0 = 0; t0 < n;) {
          const int t1 = KvCoded(f) ? groups.End(groups.Of(t0)) : n;
          for (int c = 0; c < d; ++c) {
            float lo = x[static_cast<size_t>(t0) * d + c], hi = lo;
            for (int t = t0; t < t1; ++t) {
              lo = std::min(lo, x[static_cast<size_t>(t) * d + c]);
              hi = std::max(hi, x[static_cast<size_t>(t) * d + c]);
            }
            // The f16 parameters' own rounding: a part in 2^11 of the channel's magnitude.
            const float f16 = std::max(std::fabs(lo), std::fabs(hi)) * std::ldexp(1.0f, -10);
            for (int t = t0; t < t1; ++t) {
              const float a = x[static_cast<size_t>(t) * d + c];
              const float b = back[static_cast<size_t>(t) * d + c];
              float bound = 0;
              switch (f) {
                case KvFormat::kAuto:
                  break;
                case KvFormat::kBF16:
                  bound = std::fabs(a) * std::ldexp(1.0f, -8);
                  break;
                case KvFormat::kFP8: {  // 3 mantissa bits of the distance from the centre
                  const float half = (hi - lo) / 2 + f16;
                  bound = std::max(half / 16, half / 448 * std::ldexp(1.0f, -9)) * 1.01f + f16;
                  // The extremes code to ±448 exactly: they come back as the rounded scale does.
                  if (a == hi || a == lo) bound = half * std::ldexp(1.0f, -10) + f16;
                  break;
                }
                case KvFormat::kInt8:
                  bound = (hi - lo) / 255 / 2 * 1.01f + f16;
                  break;
                case KvFormat::kInt4:
                  bound = (hi - lo) / 15 / 2 * 1.01f + f16;
                  break;
              }
              ASSERT_LE(std::fabs(a - b), bound) << "token " << t << " channel " << c << ": " << a;
            }
          }
          t0 = t1;
        }
      }
    }
  }
}

// However a stream cuts a head into blocks, each block carries its groups' parameters computed
// over the whole group, so the codes and the decoded rows are the whole head's.
TEST(KvFormat, ABlockCodesAsTheWholeHeadDoes) {
  std::mt19937 rng(9);
  const int d = 16, kept = 300;
  const std::vector<float> x = Rows(kept, d, rng);
  for (KvFormat f : kAllKvFormats) {
    SCOPED_TRACE(KvFormatName(f));
    std::vector<uint8_t> whole_k(KvKeyBlockBytes(f, DType::kF32, d, kept, 0, kept));
    std::vector<uint8_t> whole_v(KvValueBlockBytes(f, DType::kF32, d, kept, 0, kept));
    EncodeKvKeys(f, DType::kF32, d, kept, 0, kept, x.data(), whole_k.data());
    EncodeKvValues(f, DType::kF32, d, kept, 0, kept, x.data(), whole_v.data());
    std::vector<float> want(x.size()), got(x.size());
    DecodeKvKeys(f, DType::kF32, d, kept, 0, kept, whole_k.data(), want.data());
    const std::vector<int> cuts = {0, 50, 200, 290, 299, 300};
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const int first = cuts[i], n = cuts[i + 1] - cuts[i];
      std::vector<uint8_t> k(KvKeyBlockBytes(f, DType::kF32, d, kept, first, n));
      std::vector<uint8_t> v(KvValueBlockBytes(f, DType::kF32, d, kept, first, n));
      EncodeKvKeys(f, DType::kF32, d, kept, first, n, x.data(), k.data());
      EncodeKvValues(f, DType::kF32, d, kept, first, n, x.data(), v.data());
      const size_t code = KvKeyCodeBytes(f, DType::kF32, d);
      ASSERT_EQ(std::memcmp(k.data(), whole_k.data() + first * code, n * code), 0) << first;
      DecodeKvKeys(f, DType::kF32, d, kept, first, n, k.data(), got.data() + first * d);
      std::vector<float> values(static_cast<size_t>(n) * d), whole_values(x.size());
      DecodeKvValues(f, DType::kF32, d, kept, first, n, v.data(), values.data());
      DecodeKvValues(f, DType::kF32, d, kept, 0, kept, whole_v.data(), whole_values.data());
      ASSERT_EQ(std::memcmp(values.data(), whole_values.data() + first * d, values.size() * 4), 0)
          << first;
    }
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0);
  }
}

TEST(KvFormat, ValuesWithinHalfAStepOfTheirRowsRange) {
  std::mt19937 rng(8);
  for (int d : {8, 64, 96, 256}) {
    const int rows = 300;
    const KvGroups groups{rows};
    const std::vector<float> x = Rows(rows, d, rng);
    for (KvFormat f : kAllKvFormats) {
      SCOPED_TRACE(absl::StrCat(KvFormatName(f), " d=", d));
      std::vector<uint8_t> coded(KvValueBlockBytes(f, DType::kF32, d, rows, 0, rows));
      std::vector<float> back(x.size());
      EncodeKvValues(f, DType::kF32, d, rows, 0, rows, x.data(), coded.data());
      DecodeKvValues(f, DType::kF32, d, rows, 0, rows, coded.data(), back.data());
      for (int r = 0; r < rows; ++r) {
        const float* a = &x[static_cast<size_t>(r) * d];
        const float* b = &back[static_cast<size_t>(r) * d];
        float amax = 0;  // the row's, or for fp8 its group's
        const int g0 = groups.Begin(groups.Of(r)), g1 = groups.End(groups.Of(r));
        for (int t = f == KvFormat::kFP8 ? g0 : r; t < (f == KvFormat::kFP8 ? g1 : r + 1); ++t) {
          for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[size_t(t) * d + i]));
        }
        for (int i = 0; i < d; ++i) {
          float bound = 0;
          switch (f) {
            case KvFormat::kAuto:
              break;
            case KvFormat::kBF16:
              bound = std::fabs(a[i]) * std::ldexp(1.0f, -8);
              break;
            case KvFormat::kFP8:  // relative 2^-4, or a subnormal step of the power-of-two scale
              bound = std::max(std::fabs(a[i]) / 16, 2 * amax / 448 * std::ldexp(1.0f, -9)) * 1.01f;
              break;
            case KvFormat::kInt8:
              bound = amax / 127 / 2 * 1.01f;
              break;
            case KvFormat::kInt4: {
              const int g = std::min(kInt4ValueGroup, d), first = i / g * g;
              float lo = a[first], hi = a[first];
              for (int j = first; j < std::min(d, first + g); ++j) {
                lo = std::min(lo, a[j]);
                hi = std::max(hi, a[j]);
              }
              bound = (hi - lo) / 15 / 2 * 1.01f + std::fabs(lo) * std::ldexp(1.0f, -10);
              break;
            }
          }
          ASSERT_LE(std::fabs(a[i] - b[i]), bound) << "row " << r << " [" << i << "] " << a[i];
        }
      }
    }
  }
}

TEST(KvFormat, QuantisedBytesPerValue) {
  // Bytes per value of 128-dim heads: fp8 values share a byte per 128 tokens, int4 values a
  // step and a minimum per row; keys in groups of 128 tokens cost 4 bytes per channel per
  // group: 1/32 of a byte per value.
  EXPECT_NEAR(KvValueBlockBytes(KvFormat::kFP8, DType::kBF16, 128, 256, 0, 128) / (128.0 * 128),
              1.0, 1e-4);
  EXPECT_NEAR(KvValueBlockBytes(KvFormat::kInt4, DType::kBF16, 128, 1, 0, 1) / 128.0, 0.53125,
              1e-9);
  EXPECT_NEAR(KvKeyBlockBytes(KvFormat::kInt4, DType::kBF16, 128, 256, 0, 128) / (128.0 * 128),
              0.53125, 1e-9);
}

TEST(KvFormat, ZeroRowsAndNonFiniteInputAreDefined) {
  const int d = 16, n = 3;
  std::vector<float> zero(d * n, 0.0f), nan(d * n, NAN), back(d * n);
  for (KvFormat f : kAllKvFormats) {
    std::vector<uint8_t> keys(KvKeyBlockBytes(f, DType::kF32, d, n, 0, n));
    std::vector<uint8_t> values(KvValueBlockBytes(f, DType::kF32, d, n, 0, n));
    EncodeKvKeys(f, DType::kF32, d, n, 0, n, zero.data(), keys.data());
    DecodeKvKeys(f, DType::kF32, d, n, 0, n, keys.data(), back.data());
    for (float b : back) EXPECT_EQ(b, 0.0f) << KvFormatName(f);
    EncodeKvValues(f, DType::kF32, d, n, 0, n, zero.data(), values.data());
    DecodeKvValues(f, DType::kF32, d, n, 0, n, values.data(), back.data());
    for (float b : back) EXPECT_EQ(b, 0.0f) << KvFormatName(f);
    // NaN input (not a cache's, but the encoders must not invoke undefined behaviour).
    EncodeKvKeys(f, DType::kF32, d, n, 0, n, nan.data(), keys.data());
    EncodeKvValues(f, DType::kF32, d, n, 0, n, nan.data(), values.data());
  }
}

// Which zero fmin and fmax return for -0 and +0 is the library's choice, and differs between the
// host's and the GPU's; the codes of a row of zeros of either sign must not depend on it.
TEST(KvFormat, SignedZerosCodeAlike) {
  const int d = 16, n = 4;
  std::vector<float> plus(d * n, 0.0f), mixed(d * n, 0.0f);
  for (size_t i = 0; i < mixed.size(); i += 2) mixed[i] = -0.0f;
  for (KvFormat f : {KvFormat::kFP8, KvFormat::kInt8, KvFormat::kInt4}) {  // (bf16 keeps -0)
    SCOPED_TRACE(KvFormatName(f));
    std::vector<uint8_t> a(KvKeyBlockBytes(f, DType::kF32, d, n, 0, n)), b(a.size());
    EncodeKvKeys(f, DType::kF32, d, n, 0, n, plus.data(), a.data());
    EncodeKvKeys(f, DType::kF32, d, n, 0, n, mixed.data(), b.data());
    EXPECT_EQ(a, b);
    std::vector<uint8_t> c(KvValueBlockBytes(f, DType::kF32, d, n, 0, n)), e(c.size());
    EncodeKvValues(f, DType::kF32, d, n, 0, n, plus.data(), c.data());
    EncodeKvValues(f, DType::kF32, d, n, 0, n, mixed.data(), e.data());
    EXPECT_EQ(c, e);
    EXPECT_EQ(AffineFor(f, -0.0f, -0.0f).a, 0);
  }
}

}  // namespace
}  // namespace kvwire
