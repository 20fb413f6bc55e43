// The ranking order's partial selection: BestFirstPrefix is the prefix of the full sort
// (RankBestFirst) whatever the count asked for, with and without its sampled threshold, when
// the sample misleads it, with plateaus of tied scores of either sign, ±0 and NaNs.
#include "common/base/ranking.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace kvwire {
namespace {

TEST(Ranking, BestFirstPrefixIsThePrefixOfTheFullOrder) {
  std::mt19937 rng(7);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int n : {0, 1, 2, 7, 64, 100, 1000, 5000}) {
    for (int levels : {2, 5, 1 << 20}) {  // heavy ties, some, almost none
      std::vector<float> score(n);
      for (float& s : score) {
        const uint32_t v = rng();
        if (v % 97 == 0) {
          s = nan;
        } else if (v % 89 == 0) {
          s = -std::numeric_limits<float>::infinity();
        } else if (v % 83 == 0) {
          s = -0.f;  // ties with +0
        } else {
          // Both signs: the sampled threshold's score is mapped back from its key.
          s = static_cast<float>(static_cast<int>(v % levels) - levels / 2);
        }
      }
      const std::vector<int32_t> full = RankBestFirst(score);
      for (int m : {0, 1, 3, n / 8, n / 8 + 1, n / 2, n - 1, n, n + 5}) {
        if (m < 0) continue;
        std::vector<int32_t> got;
        BestFirstPrefix(score.data(), n, m, &got);
        const int want = std::max(0, std::min(m, n));
        ASSERT_EQ(got, std::vector<int32_t>(full.begin(), full.begin() + want))
            << "n " << n << " m " << m << " levels " << levels;
      }
    }
  }
}

// The sample (every n/128-th item) holds the best scores: its threshold lets fewer than m
// items through, and the selection must fall back to all of them.
TEST(Ranking, BestFirstPrefixSurvivesAMisleadingSample) {
  const int n = 5120;
  std::vector<float> score(n);
  for (int i = 0; i < n; ++i)
    score[i] = i % (n / 128) == 0 ? 1000.f + i : static_cast<float>(i % 7);
  const std::vector<int32_t> full = RankBestFirst(score);
  for (int m : {10, 100, 200, 600}) {
    std::vector<int32_t> got;
    BestFirstPrefix(score.data(), n, m, &got);
    EXPECT_EQ(got, std::vector<int32_t>(full.begin(), full.begin() + m)) << "m " << m;
  }
}

// The best m of the candidates are found by a quickselect (with AVX-512): whatever the order
// the scores come in (sorted either way, organ pipe, one plateau, random) and however many of
// the candidates are wanted, the set is the m best and the ranking the full order's prefix.
TEST(Ranking, BestFirstPrefixWhateverTheInputOrder) {
  std::mt19937 rng(11);
  for (int n : {33, 40, 100, 513, 3284, 10000}) {
    for (int pattern = 0; pattern < 5; ++pattern) {
      std::vector<float> score(n);
      for (int i = 0; i < n; ++i) {
        switch (pattern) {
          case 0:
            score[i] = static_cast<float>(i);
            break;
          case 1:
            score[i] = static_cast<float>(n - i);
            break;
          case 2:
            score[i] = static_cast<float>(std::min(i, n - i));
            break;
          case 3:
            score[i] = 0.5f;
            break;
          default:
            score[i] = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
        }
      }
      const std::vector<int32_t> full = RankBestFirst(score);
      for (int m : {1, 2, 31, 32, 33, 104, 256, 511, 512}) {
        if (m > n) continue;
        std::vector<int32_t> got;
        BestFirstPrefix(score.data(), n, m, &got);
        ASSERT_EQ(got, std::vector<int32_t>(full.begin(), full.begin() + m))
            << "n " << n << " m " << m << " pattern " << pattern;
      }
    }
  }
}

}  // namespace
}  // namespace kvwire
