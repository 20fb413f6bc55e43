// PageScores on the CPU (kernels/selection.h): RocketKV's hybrid page scores, Quest's bounds
// and exact token scores for one cache head at a time, vectorised over pages. The host
// sparse-decode path calls HeadPageScores per head on the model's threads; the backend op
// runs every segment on the pool.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/base/ranking.h"
#include "kernels/coded_rows.h"
#include "kernels/cpu/selection.h"
#include "kernels/simd.h"

// GCC 12's AVX-512 intrinsics initialise their "undefined" vectors from themselves, which
// its own -Wuninitialized then reports where they are inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kvwire::kernels::cpu {
namespace {

// Lines 4-6 for the n pages of one tile, from page `tile`:
//   u[g·n_pages + tile + p] = inv_scale[g] · Σ_x w[x·G + g] · rows[x][p],
// each sum accumulated over x in order by fused multiply-adds, and mx[g] raised to the
// largest of them. rows[x] is the tile's chunk of the x-th chosen summary row.
// Whatever the blocking, every element is the same chain of roundings as simd::Axpy down one
// row at a time (vectors of 8 from the row's start, the rest scalar), so the selection is
// the serial one's. The vector path keeps a block of pages' accumulators for every head of
// the group in registers and reads each chunk once; the plain path is that row-by-row Axpy.
struct LogitsArgs {
  const uint8_t* const* rows;  // [r], this tile's chunks
  const float* w;              // [r][group]
  const float* inv_scale;      // [group]
  int r, group, tile, n;       // tile: first page of the chunks; n: pages in the tile
  int64_t n_pages;             // u's stride between heads
  DType dtype;
  float* u;
  float* mx;  // [group]
};

#if KVWIRE_AVX2
// Summary rows read together: eight forward streams are what the hardware prefetchers follow
// best (docs/benchmarks.md, "Decode at long context").
constexpr int kRowsPerPass = 8;

// Even so the scorer waits on memory: a software prefetch this far ahead in each row, which
// past a row's end starts the next pass's row at the same place (docs/benchmarks.md, "Decode
// at long context").
constexpr int64_t kPrefetchAheadBytes = 768;

// Prefetches, in each row of the pass [x0, x1), the `bytes` (a block's) kPrefetchAheadBytes
// past byte `at` of the tile's chunk, or, past the chunk's end, of the next pass's row there:
// a line every 64 bytes, so blocks of 64 bytes or more of each row prefetch every line once.
// Always inlined: GCC finds a function that only prefetches free of side effects, and drops
// its calls.
[[gnu::always_inline]] inline void PrefetchAhead(const LogitsArgs& a, int x0, int x1, int64_t at,
                                                 int64_t bytes) {
  const int64_t chunk = int64_t{a.n} * static_cast<int64_t>(DTypeSize(a.dtype));
  for (int64_t b = 0; b < bytes; b += 64) {
    const int64_t o = at + b + kPrefetchAheadBytes;
    for (int x = x0; x < x1; ++x) {
      const uint8_t* line = o < chunk ? a.rows[x] + o
                            : o - chunk < chunk && x + kRowsPerPass < a.r
                                ? a.rows[x + kRowsPerPass] + (o - chunk)
                                : nullptr;
      if (line != nullptr) __builtin_prefetch(line, 0, 3);
    }
  }
}

// The vector widths the scorer runs in: 8 lanes, and 16 where the CPU has AVX-512 (there
// twice the multiply-adds per cycle where the units are 512 bits wide, as on Zen 5, and half
// the loads and widenings of the summary rows anywhere).
struct Lanes8 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Broadcast(float x) { return _mm256_set1_ps(x); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <DType T>
  static V LoadRow(const uint8_t* row, int64_t i) {
    return simd::LoadAs8<T>(row, i);
  }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Max(V a, V b) { return _mm256_max_ps(a, b); }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Broadcast(float x) { return _mm512_set1_ps(x); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <DType T>
  static V LoadRow(const uint8_t* row, int64_t i) {
    return simd::LoadAs16<T>(row, i);
  }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Max(V a, V b) { return _mm512_max_ps(a, b); }
};
#endif

// NV vectors of L::kLanes pages from page p of the tile, rows [x0, x1): every head's
// accumulators in registers, from zero (x0 = 0) or from u; the last pass scales them and keeps
// the max. Each page's logit is the same chain of multiply-adds whatever the width.
template <class L, int G, DType T, int NV>
inline void LogitsBlock(const LogitsArgs& a, int p, int x0, int x1, typename L::V* vmx) {
  using V = typename L::V;
  V acc[G][NV];
  for (int g = 0; g < G; ++g) {
    float* ug = a.u + g * a.n_pages + a.tile + p;
    for (int j = 0; j < NV; ++j) acc[g][j] = x0 == 0 ? L::Zero() : L::Load(ug + L::kLanes * j);
  }
  for (int x = x0; x < x1; ++x) {
    V v[NV];
    for (int j = 0; j < NV; ++j) v[j] = L::template LoadRow<T>(a.rows[x], p + L::kLanes * j);
    for (int g = 0; g < G; ++g) {
      const V wg = L::Broadcast(a.w[x * G + g]);
      for (int j = 0; j < NV; ++j) acc[g][j] = L::Fma(wg, v[j], acc[g][j]);
    }
  }
  const bool last = x1 == a.r;
  for (int g = 0; g < G; ++g) {
    const V s = L::Broadcast(a.inv_scale[g]);
    float* ug = a.u + g * a.n_pages + a.tile + p;
    for (int j = 0; j < NV; ++j) {
      if (!last) {
        L::Store(ug + L::kLanes * j, acc[g][j]);
        continue;
      }
      const V y = L::Mul(acc[g][j], s);
      L::Store(ug + L::kLanes * j, y);
      vmx[g] = L::Max(y, vmx[g]);  // a NaN y leaves the max, as std::max(mx, y) does
    }
  }
}

template <int G, DType T>
void LogitsTile(const LogitsArgs& a, __m256* vmx) {
  // Enough independent accumulators to cover the FMA latency, few enough to stay in registers.
#if defined(__AVX512F__)
  constexpr int kV = G >= 4 ? 2 : 4;  // 32 registers
  __m512 wide[G];
  for (int g = 0; g < G; ++g) wide[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#else
  constexpr int kV = G >= 8 ? 1 : (G >= 4 ? 2 : 4);
#endif
  constexpr int64_t kElem = T == DType::kF32 ? 4 : 2;  // bytes per summary element
  for (int x0 = 0; x0 < a.r; x0 += kRowsPerPass) {
    const int x1 = std::min(a.r, x0 + kRowsPerPass);
    int p = 0;
#if defined(__AVX512F__)
    for (; p + 16 * kV <= a.n; p += 16 * kV) {
      PrefetchAhead(a, x0, x1, int64_t{p} * kElem, 16 * kV * kElem);
      LogitsBlock<Lanes16, G, T, kV>(a, p, x0, x1, wide);
    }
    for (; p + 16 <= a.n; p += 16) LogitsBlock<Lanes16, G, T, 1>(a, p, x0, x1, wide);
#else
    for (; p + 8 * kV <= a.n; p += 8 * kV) {
      PrefetchAhead(a, x0, x1, int64_t{p} * kElem, 8 * kV * kElem);
      LogitsBlock<Lanes8, G, T, kV>(a, p, x0, x1, vmx);
    }
#endif
    for (; p + 8 <= a.n; p += 8) LogitsBlock<Lanes8, G, T, 1>(a, p, x0, x1, vmx);
  }
#if defined(__AVX512F__)
  // The wide maxima join the 8-lane ones (neither holds a NaN: see LogitsBlock).
  for (int g = 0; g < G; ++g) {
    const __m256 lo = _mm512_castps512_ps256(wide[g]);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[g]), 1));
    vmx[g] = _mm256_max_ps(_mm256_max_ps(lo, hi), vmx[g]);
  }
#endif
}

template <int G>
bool LogitsTileVector(const LogitsArgs& a, __m256* vmx) {
  switch (a.dtype) {
    case DType::kF32:
      LogitsTile<G, DType::kF32>(a, vmx);
      return true;
    case DType::kBF16:
      LogitsTile<G, DType::kBF16>(a, vmx);
      return true;
    case DType::kF16:
      LogitsTile<G, DType::kF16>(a, vmx);
      return true;
  }
  return false;
}
#endif

// One tile's pages: the vector path over whole vectors of 8 for the group sizes it is
// compiled for; everything else (and the last pages, past the last whole vector of the
// last tile) by Axpy, then scaled, with the max kept as the serial code keeps it.
void LogitsOfTile(const LogitsArgs& a) {
  int done = 0;
#if KVWIRE_AVX2
  __m256 vmx[8];
  bool vector = a.group == 1 || a.group == 2 || a.group == 4 || a.group == 8;
  if (vector) {
    for (int g = 0; g < a.group; ++g) vmx[g] = _mm256_set1_ps(a.mx[g]);
    switch (a.group) {
      case 1:
        vector = LogitsTileVector<1>(a, vmx);
        break;
      case 2:
        vector = LogitsTileVector<2>(a, vmx);
        break;
      case 4:
        vector = LogitsTileVector<4>(a, vmx);
        break;
      default:
        vector = LogitsTileVector<8>(a, vmx);
    }
  }
  if (vector) {
    done = a.n / 8 * 8;
    for (int g = 0; g < a.group; ++g) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmx[g]);
      for (float l : lanes) a.mx[g] = std::max(a.mx[g], l);
    }
  }
#endif
  const size_t es = DTypeSize(a.dtype);
  for (int g = 0; g < a.group; ++g) {
    float* ug = a.u + g * a.n_pages + a.tile;
    std::fill(ug + done, ug + a.n, 0.f);
  }
  if (done == a.n) return;
  for (int x = 0; x < a.r; ++x) {
    for (int g = 0; g < a.group; ++g) {
      simd::Axpy(a.w[x * a.group + g], a.rows[x] + done * es, a.dtype,
                 a.u + g * a.n_pages + a.tile + done, a.n - done);
    }
  }
  for (int g = 0; g < a.group; ++g) {
    float* ug = a.u + g * a.n_pages + a.tile;
    for (int p = done; p < a.n; ++p) {
      ug[p] *= a.inv_scale[g];
      a.mx[g] = std::max(a.mx[g], ug[p]);
    }
  }
}

// RocketKV Algorithm 2 lines 3-6 for one cache head (kernels/selection.h, kHybrid).
void HybridScores(const PageScoreSegment& s, int d, DType dtype) {
  const SummaryLayout& l = s.layout;
  const float* q = s.q;
  const int group = s.group, r = std::min(s.top_r, d);
  const int n_pages = l.pages(s.len);
  // Per head and step, on the backend's threads: scratch kept per thread.
  thread_local std::vector<float> a, sum, w, inv_scale, mx, u, inv_z;
  thread_local std::vector<int32_t> dims;
  thread_local std::vector<const uint8_t*> rows;
  // Line 3: the r dimensions with the largest Σ_g |q_g|, best first.
  a.assign(d, 0.f);
  sum.assign(d, 0.f);
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < d; ++i) {
      a[i] += std::fabs(q[g * d + i]);
      sum[i] += q[g * d + i];
    }
  }
  BestFirstPrefix(a.data(), d, r, &dims);
  // SparQ-style temperature: each head's scale sqrt(d · ||q_I||_1 / ||q||_1).
  inv_scale.resize(group);
  w.resize(static_cast<size_t>(r) * group);
  for (int g = 0; g < group; ++g) {
    const float* qh = q + g * d;
    float num = 0.f, den = 0.f;
    for (int x = 0; x < r; ++x) num += std::fabs(qh[dims[x]]);
    for (int i = 0; i < d; ++i) den += std::fabs(qh[i]);
    inv_scale[g] = den > 0.f && num > 0.f ? 1.f / std::sqrt(d * num / den) : 1.f;
    for (int x = 0; x < r; ++x) w[static_cast<size_t>(x) * group + g] = qh[dims[x]];
  }
  // Lines 4-6: per dimension K_max where Σ_g q ≥ 0 else K_min; per-head page logits,
  // scaled, tile by tile in address order (page_summaries.h).
  u.resize(static_cast<size_t>(group) * n_pages);
  mx.assign(group, -std::numeric_limits<float>::infinity());
  // Hybrid attention keeps its summaries as whole rows (one tile): r rows, each a stream.
  const int kT = l.tile_pages;
  const size_t es = DTypeSize(dtype);
  const auto* block = static_cast<const uint8_t*>(s.summaries);
  rows.resize(r);
  for (int64_t tile = 0; tile * kT < n_pages; ++tile) {
    const int first = static_cast<int>(tile * kT);
    for (int x = 0; x < r; ++x) {
      rows[x] = block + l.RowOffset(sum[dims[x]] >= 0.f, dims[x], static_cast<int>(tile)) * es;
    }
    LogitsOfTile(LogitsArgs{rows.data(), w.data(), inv_scale.data(), r, group, first,
                            std::min(kT, n_pages - first), n_pages, dtype, u.data(), mx.data()});
  }
  // A softmax per head over slots (each slot carries its page's logit), then the group's sum.
  const int page = l.page;
  const int last_page_slots = s.len - (n_pages - 1) * page;
  // Each head's sum of exps (u then holds the exps), then 1/z: every page but the last holds
  // `page` slots, each carrying the page's logit.
  inv_z.resize(group);
  simd::ExpShiftSumRows(u.data(), n_pages, group, n_pages, mx.data(), inv_z.data());
  for (int g = 0; g < group; ++g) {
    const float last = u[static_cast<size_t>(g) * n_pages + n_pages - 1];
    inv_z[g] = 1.f / (inv_z[g] * page - last * static_cast<float>(page - last_page_slots));
  }
  // score = Σ_g u_g / z_g, the heads added in order by multiply-adds: simd::Axpy head after
  // head over a zeroed score, in one pass.
  float* score = s.score;
  int done = 0;
#if KVWIRE_AVX2
  for (; done + 8 <= n_pages; done += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int g = 0; g < group; ++g) {
      acc =
          _mm256_fmadd_ps(_mm256_set1_ps(inv_z[g]),
                          _mm256_loadu_ps(u.data() + static_cast<size_t>(g) * n_pages + done), acc);
    }
    _mm256_storeu_ps(score + done, acc);
  }
#endif
  std::fill(score + done, score + n_pages, 0.f);
  for (int g = 0; g < group; ++g) {
    simd::Axpy(inv_z[g], u.data() + static_cast<size_t>(g) * n_pages + done, DType::kF32,
               score + done, n_pages - done);
  }
}

#if KVWIRE_AVX2
// bound[p] for V vectors of 8 pages from p: Σ over the terms in order, in registers.
template <DType T, int V>
inline void BoundBlock(const uint8_t* const* rows, const float* w, int terms, int p, float* bound) {
  __m256 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
  for (int x = 0; x < terms; ++x) {
    const __m256 wx = _mm256_set1_ps(w[x]);
    for (int j = 0; j < V; ++j) {
      acc[j] = _mm256_fmadd_ps(wx, simd::LoadAs8<T>(rows[x], p + 8 * j), acc[j]);
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
void QuestScores(const PageScoreSegment& s, int d, DType dtype) {
  const SummaryLayout& l = s.layout;
  const int n_pages = l.pages(s.len);
  const int terms = d * s.group;
  thread_local std::vector<float> w;
  thread_local std::vector<const uint8_t*> rows;
  w.resize(terms);
  rows.resize(terms);
  for (int i = 0; i < d; ++i) {
    for (int g = 0; g < s.group; ++g) w[i * s.group + g] = s.q[g * d + i];
  }
  const size_t es = DTypeSize(dtype);
  const auto* block = static_cast<const uint8_t*>(s.summaries);
  const int kT = l.tile_pages;
  for (int64_t tile = 0; tile * kT < n_pages; ++tile) {
    const int first = static_cast<int>(tile * kT);
    const int n = std::min(kT, n_pages - first);
    for (int x = 0; x < terms; ++x) {
      rows[x] = block + l.RowOffset(w[x] >= 0.f, x / s.group, static_cast<int>(tile)) * es;
    }
    float* b = s.score + first;
    int done = 0;
#if KVWIRE_AVX2
    switch (dtype) {
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
      simd::Axpy(w[x], rows[x] + done * es, dtype, b + done, n - done);
    }
  }
}

// Exact softmax scores per query head, summed over the group: the exact top-k oracle.
void ExactScores(const PageScoreSegment& s, int d, DType dtype) {
  thread_local std::vector<float> e, row;
  e.resize(s.len);
  row.resize(d);
  std::fill(s.score, s.score + s.len, 0.f);
  const size_t es = DTypeSize(dtype);
  const auto* k = static_cast<const uint8_t*>(s.k);
  for (int g = 0; g < s.group; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < s.len; ++t) {
      if (s.coding.coded()) {
        CodedKeyRow(k, s.kv, s.coding, dtype, d, s.len, s.head, t, row.data());
      } else {
        ToFloat(dtype, k + s.kv.Row(s.head, t, d) * static_cast<int64_t>(es), row.data(), d);
      }
      float dot = 0.f;
      for (int i = 0; i < d; ++i) dot += s.q[g * d + i] * row[i];
      e[t] = dot * s.scale;
      mx = std::max(mx, e[t]);
    }
    double z = 0;
    for (int t = 0; t < s.len; ++t) z += e[t] = std::exp(e[t] - mx);
    for (int t = 0; t < s.len; ++t) s.score[t] += static_cast<float>(e[t] / z);
  }
}

}  // namespace

void HeadPageScores(const PageScoreSegment& s, int head_dim, DType dtype) {
  switch (s.kind) {
    case PageScoreKind::kHybrid:
      HybridScores(s, head_dim, dtype);
      return;
    case PageScoreKind::kQuest:
      QuestScores(s, head_dim, dtype);
      return;
    case PageScoreKind::kExact:
      ExactScores(s, head_dim, dtype);
      return;
  }
}

void PageScores(const PageScoresParams& p, const ParallelFn& parallel) {
  parallel(p.count, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) HeadPageScores(p.segs[i], p.head_dim, p.dtype);
  });
}

}  // namespace kvwire::kernels::cpu
