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
#include <cstring>
#include <functional>
#include <numeric>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// The key of item i of `score` in BestFirst's order (no tie scores): a larger key ranks
// first. The score maps to an unsigned integer in the same order (−0 as +0, NaN below −∞),
// the index fills the low half inverted, so that of equal scores the lower index has the
// larger key. Keys compare as integers: no branch on NaN, nor on ties.
inline uint64_t BestFirstKey(float s, int32_t i) {
  uint32_t b;
  std::memcpy(&b, &s, sizeof(b));
  b = (b << 1) == 0 ? 0 : b;  // −0 as +0
  const uint32_t ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
  return (uint64_t{nan ? 0u : ordered} << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

// The `m` best indices of score[0, n), best first: the first m of RankBestFirst's order,
// found without sorting all n. For a few of many (pages from thousands), a threshold from a
// strided sample of keys, set so that about 2m items pass it, filters the items in one
// branch-free pass; when fewer than m pass, all do. The m best of
// the candidates (nth_element) are then ranked. Exact whatever the sample: every key of the m
// best is at least the m-th best key, which is at least the threshold once m items pass it.
// `out` is resized to min(m, n).
inline void BestFirstPrefix(const float* score, int n, int m, std::vector<int32_t>* out) {
  m = std::max(0, std::min(m, n));
  out->resize(m);
  if (m == 0) return;
  thread_local std::vector<uint64_t> keys;
  thread_local std::vector<int32_t> candidates;
  const auto greater = std::greater<uint64_t>();
  constexpr int kSample = 128;
  uint64_t threshold = 0;  // keys are distinct: an item passes when its key is at least this
  if (n > 8 * kSample && 8 * static_cast<int64_t>(m) < n) {
    keys.resize(kSample);
    for (int j = 0; j < kSample; ++j) {
      const int32_t i = static_cast<int32_t>(static_cast<int64_t>(j) * n / kSample);
      keys[j] = BestFirstKey(score[i], i);
    }
    const int t = static_cast<int>(std::min<int64_t>(kSample, 2 * int64_t{m} * kSample / n + 2));
    std::nth_element(keys.begin(), keys.begin() + (t - 1), keys.end(), greater);
    threshold = keys[t - 1];
  }
  // Room past n for the vector loops: 16 candidates stored at a time, and the ranking's last
  // vector of 8 keys.
  keys.resize(static_cast<size_t>(n) + 8);
  candidates.resize(static_cast<size_t>(n) + 16);
  size_t passed = 0;
  for (int pass = 0; pass < 2; ++pass) {
    // An item scored below the threshold's score cannot pass (its key is smaller whatever the
    // index; NaN fails the compare as its key fails the threshold), so a vector compare of
    // the scores picks the candidates and only they are keyed. The threshold's score is its
    // key's high half mapped back to a float; a NaN threshold (every key passes it) is not
    // filtered.
    int32_t i = 0;
    size_t count = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    if (const uint32_t hi = static_cast<uint32_t>(threshold >> 32); hi != 0) {
      const uint32_t bits = (hi & 0x80000000u) ? (hi & 0x7FFFFFFFu) : ~hi;
      float floor;
      std::memcpy(&floor, &bits, sizeof(floor));
#if defined(__AVX512F__)
      // Sixteen at a time, the passing indices packed into place (branch-free).
      const __m512 f = _mm512_set1_ps(floor);
      __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (; i + 16 <= n; i += 16, index = _mm512_add_epi32(index, _mm512_set1_epi32(16))) {
        const __mmask16 pass_mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(score + i), f, _CMP_GE_OQ);
        _mm512_storeu_si512(candidates.data() + count,
                            _mm512_maskz_compress_epi32(pass_mask, index));
        count += static_cast<size_t>(__builtin_popcount(pass_mask));
      }
#else
      const __m256 f = _mm256_set1_ps(floor);
      for (; i + 8 <= n; i += 8) {
        auto mask = static_cast<uint32_t>(
            _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(score + i), f, _CMP_GE_OQ)));
        for (; mask != 0; mask &= mask - 1) candidates[count++] = i + __builtin_ctz(mask);
      }
#endif
    }
#endif
    for (; i < n; ++i) candidates[count++] = i;
    // Branch-free: every key is written, and the next write goes past it if it passed.
    passed = 0;
    for (size_t c = 0; c < count; ++c) {
      const int32_t j = candidates[c];
      const uint64_t k = BestFirstKey(score[j], j);
      keys[passed] = k;
      passed += k >= threshold;
    }
    if (passed >= static_cast<size_t>(m)) break;
    threshold = 0;  // the sample misled: every item
  }
  std::nth_element(keys.begin(), keys.begin() + (m - 1), keys.begin() + passed, greater);
  if (m <= 512) {
    // Each key's place is the count of keys above it: branch-free (and vectorized), where a
    // comparison sort of scores in random order mispredicts half its branches.
#if defined(__AVX512F__)
    std::fill(keys.begin() + m, keys.begin() + ((m + 7) & ~7), 0);  // below every key
    for (int i = 0; i < m; ++i) {
      const __m512i key = _mm512_set1_epi64(static_cast<long long>(keys[i]));
      int above = 0;
      for (int j = 0; j < m; j += 8) {
        above += __builtin_popcount(_mm512_cmpgt_epu64_mask(_mm512_loadu_si512(&keys[j]), key));
      }
      (*out)[above] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(keys[i]));
    }
#else
    for (int i = 0; i < m; ++i) {
      int above = 0;
      for (int j = 0; j < m; ++j) above += keys[j] > keys[i];
      (*out)[above] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(keys[i]));
    }
#endif
    return;
  }
  std::sort(keys.begin(), keys.begin() + m, greater);
  for (int j = 0; j < m; ++j) {
    (*out)[j] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(keys[j]));
  }
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
