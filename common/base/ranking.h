// The one order in which kvwire ranks scored items (token positions, pages, chunks, blocks,
// head dimensions): the higher score first; among equal scores the higher tie-break score
// (when one is given); then the lower index. Max-pooling and page summaries make plateaus of
// equal scores, so ties are common; this rule makes every selection deterministic and
// identical wherever it is computed. A NaN score ranks below every number (as −∞ does, and
// below it), so the order stays a strict weak order whatever the scores hold.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kvwire {

// a ranks before b: the larger number, a number before NaN.
template <typename T>
bool ScoreBefore(T a, T b) {
  if (std::isnan(b)) return !std::isnan(a);
  if (std::isnan(a)) return false;
  return a > b;
}

// Strict weak order over indices into `score`: score, then `tie` (null: none), then index.
template <typename T>
struct BestFirst {
  const T* score;
  const T* tie = nullptr;
  bool operator()(int32_t a, int32_t b) const {
    if (ScoreBefore(score[a], score[b])) return true;
    if (ScoreBefore(score[b], score[a])) return false;
    if (tie != nullptr) {
      if (ScoreBefore(tie[a], tie[b])) return true;
      if (ScoreBefore(tie[b], tie[a])) return false;
    }
    return a < b;
  }
};

// Indices 0..n-1 of `score`, best first.
template <typename T>
std::vector<int32_t> RankBestFirst(const std::vector<T>& score) {
  std::vector<int32_t> order(score.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), BestFirst<T>{score.data()});
  return order;
}

// The `n` best indices of `score` (all when n exceeds the count), ties broken by `tie`
// (when given, the same length) and then the lower index, in ascending index order.
template <typename T>
std::vector<int32_t> TopKAscending(const std::vector<T>& score, int n,
                                   const std::vector<T>* tie = nullptr) {
  std::vector<int32_t> idx(score.size());
  std::iota(idx.begin(), idx.end(), 0);
  n = std::min<int>(n, static_cast<int>(idx.size()));
  std::nth_element(idx.begin(), idx.begin() + n, idx.end(),
                   BestFirst<T>{score.data(), tie ? tie->data() : nullptr});
  idx.resize(n);
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace kvwire
