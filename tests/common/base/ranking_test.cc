// The ranking order's partial selection: BestFirstPrefix is the prefix of the full sort
// (RankBestFirst) whatever the count asked for, with and without its sampled threshold, when
// the sample misleads it, with plateaus of tied scores of either sign, ±0 and NaNs.
#include "common/base/ranking.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace kvwire
