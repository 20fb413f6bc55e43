// The one order in which kvwire ranks scored items (token positions, pages, chunks, blocks,
// head dimensions): the higher score first, and among equal scores the lower index.
// Max-pooling and page summaries make plateaus of equal scores, so ties are common; this
// rule makes every selection deterministic and identical wherever it is computed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kvwire {

// Strict weak order over indices into `score` (scores must not be NaN).
template <typename T>
struct BestFirst {
  const T* score;
  bool operator()(int32_t a, int32_t b) const {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
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

// The `n` best indices of `score` (all when n exceeds the count), in ascending index order.
template <typename T>
std::vector<int32_t> TopKAscending(const std::vector<T>& score, int n) {
  std::vector<int32_t> idx(score.size());
  std::iota(idx.begin(), idx.end(), 0);
  n = std::min<int>(n, static_cast<int>(idx.size()));
  std::nth_element(idx.begin(), idx.begin() + n, idx.end(), BestFirst<T>{score.data()});
  idx.resize(n);
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace kvwire
