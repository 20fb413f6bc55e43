// The ranking order's partial selection: BestFirstPrefix is the prefix of the full sort
// (RankBestFirst) whatever the count asked for, on both of its paths (a heap for a few of many,
// nth_element for more), with plateaus of tied scores and NaNs.
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
        s = v % 97 == 0 ? nan
                        : (v % 89 == 0 ? -std::numeric_limits<float>::infinity()
                                       : static_cast<float>(v % levels));
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

}  // namespace
}  // namespace kvwire
