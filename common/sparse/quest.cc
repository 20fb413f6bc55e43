// `quest`: Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
// Inference", ICML 2024), as RocketKV compares against it: per page of P keys the upper
// bound Σ_i max(q_i·K_max,i, q_i·K_min,i) over every head dimension, summed over the
// group's query heads; the best pages are attended exactly, whole. Reading both summaries of
// a page costs one token-equivalent, so a budget t buys t/2 tokens and t/2 pages (P = 2n/t);
// k is then rounded down to whole pages, at least one (a budget smaller than a page reads
// one page: Quest cannot attend part of one).
#include <algorithm>
#include <cmath>

#include "common/sparse/attention.h"
#include "kernels/simd.h"

namespace kvwire {
namespace {

#if KVWIRE_AVX2
// bound[p] for V vectors of 8 pages from p: Σ over the terms in order, in registers.
template <DType T, int V>
inline void BoundBlock(const uint8_t* const* rows, const float* w, int terms, int p, float* bound) {
  __m256 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
  for (int x = 0; x < terms; ++x) {
    const __m256 wx = _mm256_set1_ps(w[x]);
    for (int j = 0; j < V; ++j) {
      acc[j] = _mm256_fmadd_ps(wx, kernels::simd::LoadAs8<T>(rows[x], p + 8 * j), acc[j]);
    }
  }
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(bound + p + 8 * j, acc[j]);
}

// Whole vectors of 8 pages of one tile; returns how many pages that was.
template <DType T>
int BoundTile(const uint8_t* const* rows, const float* w, int terms, int n, float* bound) {
  constexpr int kV = 8;  // the FMA latency times its throughput, in independent chains
  int p = 0;
  for (; p + 8 * kV <= n; p += 8 * kV) BoundBlock<T, kV>(rows, w, terms, p, bound);
  for (; p + 8 <= n; p += 8) BoundBlock<T, 1>(rows, w, terms, p, bound);
  return p;
}
#endif

// Σ_i Σ_g q_g,i · (q_g,i ≥ 0 ? K_max,i : K_min,i) per page, accumulated term by term (i, then
// g) in that order by fused multiply-adds, tile by tile in address order. Every element is the
// same chain of roundings as simd::Axpy down one summary row at a time (vectors of 8 from the
// row's start, the rest scalar); the vector path keeps a block of pages in registers.
void QuestSelect(const HeadQuery& hq) {
  const LayerCache& lc = *hq.cache;
  const PageSummaries& sums = *hq.summaries;
  const int d = lc.head_dim;
  const int n_pages = sums.pages(lc.len);
  const int terms = d * hq.group;
  thread_local std::vector<float> bound, w;
  thread_local std::vector<const uint8_t*> rows;
  bound.resize(n_pages);
  w.resize(terms);
  rows.resize(terms);
  for (int i = 0; i < d; ++i) {
    for (int g = 0; g < hq.group; ++g) w[i * hq.group + g] = hq.q[g * d + i];
  }
  const size_t es = DTypeSize(lc.dtype);
  const int kT = sums.tile_pages();
  for (int tile = 0; tile * kT < n_pages; ++tile) {
    const int first = tile * kT;
    const int n = std::min(kT, n_pages - first);
    for (int x = 0; x < terms; ++x) {
      rows[x] = sums.Chunk(hq.layer, hq.head, w[x] >= 0.f, x / hq.group, tile);
    }
    float* b = bound.data() + first;
    int done = 0;
#if KVWIRE_AVX2
    switch (lc.dtype) {
      case DType::kF32:
        done = BoundTile<DType::kF32>(rows.data(), w.data(), terms, n, b);
        break;
      case DType::kBF16:
        done = BoundTile<DType::kBF16>(rows.data(), w.data(), terms, n, b);
        break;
      case DType::kF16:
        done = BoundTile<DType::kF16>(rows.data(), w.data(), terms, n, b);
        break;
    }
#endif
    if (done == n) continue;
    std::fill(b + done, b + n, 0.f);
    for (int x = 0; x < terms; ++x) {
      kernels::simd::Axpy(w[x], rows[x] + done * es, lc.dtype, b + done, n - done);
    }
  }
  TakePages(bound, sums.page(), lc.len, hq.params->top_k, hq.out);
}

absl::StatusOr<SparseParams> ResolveQuest(const DecodeAttentionConfig& c, int capacity,
                                          int head_dim) {
  SparseParams p;
  p.mode = AttentionMode::kQuest;
  const int t = c.token_budget;
  p.page_size = t > 0 ? std::max(1, static_cast<int>(std::ceil(2.0 * capacity / t))) : 16;
  p.top_r = head_dim;
  p.top_k = t > 0 ? std::max(1, t / 2) : 0;
  return p;
}

// Whole pages: k rounded down to a multiple of P, at least one page.
void WholePages(SparseParams* p) { p->top_k = std::max(1, p->top_k / p->page_size) * p->page_size; }

// k tokens, and both summaries of every page (one, for pages of one token).
int64_t QuestBytes(const SparseParams& p, int len, int64_t row, int64_t) {
  const int64_t pages = (len + p.page_size - 1) / p.page_size;
  return 2 * row * p.top_k + pages * (p.page_size == 1 ? 1 : 2) * row;
}

const AttentionModeInfo& Info() {
  static const AttentionModeInfo* const info =
      new AttentionModeInfo{AttentionMode::kQuest,
                            "quest",
                            "Quest (ICML 2024), as compared in RocketKV",
                            {"token_budget", "top_k", "page_size"},
                            /*summaries=*/true,
                            &ResolveQuest,
                            &QuestBytes,
                            &QuestSelect,
                            &WholePages,
                            PageSummaries::kTilePages};
  return *info;
}

}  // namespace

const AttentionModeInfo& QuestModeInfo() { return Info(); }

}  // namespace kvwire
