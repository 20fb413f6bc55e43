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

#if defined(__AVX512F__)
// Moves the m largest of keys[0, count) (distinct; 1 ≤ m ≤ count) to keys[0, m), in no
// particular order. A quickselect whose partitions are vector compares and compresses of 8
// keys at a time, with no branch per key: std::nth_element's comparisons mispredict about every
// other time on scores in random order, and it took half of a page selection's top-k. Pivots
// are medians of three; a run of bad ones ends in std::nth_element on what is left.
inline void SelectLargestKeys(uint64_t* keys, size_t count, size_t m) {
  thread_local std::vector<uint64_t> buffer[3];
  for (auto& b : buffer) b.resize(count + 8);  // a compress stores 8 keys past its count
  std::copy(keys, keys + count, buffer[0].data());
  int in = 0;  // the range still to split: buffer[in][0, n)
  size_t n = count, need = m, taken = 0;
  for (int round = 0;; ++round) {
    uint64_t* range = buffer[in].data();
    if (n <= 32 || round == 48) {
      std::nth_element(range, range + (need - 1), range + n, std::greater<uint64_t>());
      std::copy(range, range + need, keys + taken);
      return;
    }
    const uint64_t a = range[0], b = range[n / 2], c = range[n - 1];
    const uint64_t pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    const int gt_buf = (in + 1) % 3, lt_buf = (in + 2) % 3;
    uint64_t* gt = buffer[gt_buf].data();
    uint64_t* lt = buffer[lt_buf].data();
    size_t ng = 0, nl = 0, i = 0;
    const __m512i vp = _mm512_set1_epi64(static_cast<long long>(pivot));
    for (; i + 8 <= n; i += 8) {
      const __m512i v = _mm512_loadu_si512(range + i);
      const __mmask8 above = _mm512_cmpgt_epu64_mask(v, vp);
      const __mmask8 below = _mm512_cmplt_epu64_mask(v, vp);
      _mm512_storeu_si512(gt + ng, _mm512_maskz_compress_epi64(above, v));
      _mm512_storeu_si512(lt + nl, _mm512_maskz_compress_epi64(below, v));
      ng += static_cast<size_t>(__builtin_popcount(above));
      nl += static_cast<size_t>(__builtin_popcount(below));
    }
    for (; i < n; ++i) {
      if (range[i] > pivot) gt[ng++] = range[i];
      if (range[i] < pivot) lt[nl++] = range[i];
    }
    if (ng >= need) {  // the m largest are all above the pivot
      in = gt_buf;
      n = ng;
      continue;
    }
    // Everything above the pivot and the pivot itself are among them; the rest is below.
    std::copy(gt, gt + ng, keys + taken);
    taken += ng;
    keys[taken++] = pivot;
    need -= ng + 1;
    if (need == 0) return;
    in = lt_buf;
    n = nl;
  }
}
#endif

// The `m` best indices of score[0, n), best first: the first m of RankBestFirst's order,
// found without sorting all n. For a few of many (pages from thousands), a threshold from a
// strided sample of keys, set so that about 2m items pass it, filters the items in one
// branch-free pass; when fewer than m pass, all do. The m best of the candidates (a vector
// quickselect with AVX-512, else nth_element) are then ranked. Exact whatever the sample and
// whatever the selection's pivots (the m best keys are one set): every key of the m
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
  if (m <= 512) {
    // Each key's place is the count of keys above it: branch-free (and vectorized), where a
    // comparison sort of scores in random order mispredicts half its branches.
#if defined(__AVX512F__)
    SelectLargestKeys(keys.data(), passed, static_cast<size_t>(m));
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
    std::nth_element(keys.begin(), keys.begin() + (m - 1), keys.begin() + passed, greater);
    for (int i = 0; i < m; ++i) {
      int above = 0;
      for (int j = 0; j < m; ++j) above += keys[j] > keys[i];
      (*out)[above] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(keys[i]));
    }
#endif
    return;
  }
  std::nth_element(keys.begin(), keys.begin() + (m - 1), keys.begin() + passed, greater);
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
