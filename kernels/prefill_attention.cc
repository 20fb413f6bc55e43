#include "kernels/prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/simd.h"

namespace kvwire::kernels {
namespace {

constexpr int kQueryTile = 16;
constexpr int kKeyTile = 64;  // a multiple of 8: whole vectors of keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// kt[x·kKeyTile + j] = k[j·stride + x] for the tile's n keys; keys past n are 0.
void TransposeKeyTile(const float* k, int64_t stride, int n, int d, float* kt) {
  int x = 0;
#if KVWIRE_AVX2
  for (; x + 8 <= d; x += 8) {
    for (int j0 = 0; j0 < kKeyTile; j0 += 8) {
      __m256 r[8];
      for (int u = 0; u < 8; ++u) {
        r[u] = j0 + u < n ? _mm256_loadu_ps(k + (j0 + u) * stride + x) : _mm256_setzero_ps();
      }
      simd::Transpose8x8(r);
      for (int u = 0; u < 8; ++u) _mm256_storeu_ps(kt + (x + u) * kKeyTile + j0, r[u]);
    }
  }
#endif
  for (; x < d; ++x) {
    for (int j = 0; j < kKeyTile; ++j) kt[x * kKeyTile + j] = j < n ? k[j * stride + x] : 0.f;
  }
}

// vt[j·d + x] = v[j·stride + x] for the tile's n value rows. The rows of one KV head sit a
// whole K/V row apart, so in place they share a few L1 sets and evict each other; the copy
// stays in L1 for every query row of the task (docs/benchmarks.md, "Engine").
void CopyValueTile(const float* v, int64_t stride, int n, int d, float* vt) {
  for (int j = 0; j < n; ++j) std::copy(v + j * stride, v + j * stride + d, vt + j * d);
}

// s[j] = scale · q·k_j for the kKeyTile keys of a transposed tile; returns max over j < n,
// after setting s[j] = -inf for j ≥ n (keys past the diagonal or the tile's end).
float ScoreRow(const float* q, const float* kt, int d, float scale, int n, float* s) {
#if KVWIRE_AVX2
  constexpr int kVecs = kKeyTile / 8;
  __m256 acc[kVecs];
  for (int v = 0; v < kVecs; ++v) acc[v] = _mm256_setzero_ps();
  for (int x = 0; x < d; ++x) {
    const __m256 qx = _mm256_broadcast_ss(q + x);
    const float* row = kt + x * kKeyTile;
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v)
      acc[v] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(row + 8 * v), acc[v]);
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(s + 8 * v, _mm256_mul_ps(acc[v], sc));
  std::fill(s + n, s + kKeyTile, kNegInf);
  return simd::Max(s, kKeyTile);
#else
  float mx = kNegInf;
  for (int j = 0; j < kKeyTile; ++j) {
    float acc = 0.f;
    for (int x = 0; x < d; ++x) acc += q[x] * kt[x * kKeyTile + j];
    s[j] = j < n ? acc * scale : kNegInf;
    mx = std::max(mx, s[j]);
  }
  return mx;
#endif
}

#if KVWIRE_AVX2
// a[0..8·DV) += Σ_j p[j] · v_j over n value rows, in registers: S independent sets of
// accumulators (keys j ≡ s mod S) for short rows, whose single chain would wait on each FMA.
template <int DV>
void AccumulateValues(const float* p, int n, const float* v, int64_t stride, float* a) {
  constexpr int S = DV >= 8 ? 1 : (DV >= 4 ? 2 : 4);
  __m256 acc[S][DV];
  for (int u = 0; u < DV; ++u) acc[0][u] = _mm256_loadu_ps(a + 8 * u);
  for (int t = 1; t < S; ++t) {
    for (int u = 0; u < DV; ++u) acc[t][u] = _mm256_setzero_ps();
  }
  int j = 0;
  for (; j + S <= n; j += S) {
#pragma GCC unroll 4
    for (int t = 0; t < S; ++t) {
      const __m256 pj = _mm256_broadcast_ss(p + j + t);
      const float* row = v + (j + t) * stride;
#pragma GCC unroll 16
      for (int u = 0; u < DV; ++u)
        acc[t][u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(row + 8 * u), acc[t][u]);
    }
  }
  for (; j < n; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    for (int u = 0; u < DV; ++u)
      acc[0][u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * stride + 8 * u), acc[0][u]);
  }
  for (int t = 1; t < S; ++t) {
    for (int u = 0; u < DV; ++u) acc[0][u] = _mm256_add_ps(acc[0][u], acc[t][u]);
  }
  for (int u = 0; u < DV; ++u) _mm256_storeu_ps(a + 8 * u, acc[0][u]);
}
#endif

// a[0..d) += Σ_j p[j] · v_j over n contiguous value rows of d elements (CopyValueTile's).
void WeightedValues(const float* p, int n, const float* v, int d, float* a) {
#if KVWIRE_AVX2
  switch (d) {
    case 8:
      return AccumulateValues<1>(p, n, v, d, a);
    case 16:
      return AccumulateValues<2>(p, n, v, d, a);
    case 32:
      return AccumulateValues<4>(p, n, v, d, a);
    case 64:
      return AccumulateValues<8>(p, n, v, d, a);
    case 128:
      return AccumulateValues<16>(p, n, v, d, a);
    default:
      break;
  }
#endif
  for (int j = 0; j < n; ++j) simd::Axpy(p[j], v + j * d, DType::kF32, a, d);
}

#if defined(__AVX512F__)
// NH query heads of a GQA group at once, in 512-bit vectors: each load of the transposed key
// tile, and of a value row, feeds every head, and the heads' accumulators are independent FMA
// chains that hide the instruction's latency. Where the vector units are 512 bits wide (Zen 5)
// this is twice the FMA throughput of the 256-bit loops; where they split 512-bit operations
// in two (Zen 4) it halves the instructions and loads. Every accumulator lane is the same chain
// of multiply-adds, in the same order, as ScoreRow's and AccumulateValues' for one head (head_dim
// 64 and 128), so the results are theirs bit for bit.
constexpr int kKeyVecs = kKeyTile / 16;

// acc[h][u] += b[h·stride] · a[16u .. 16u + 16) for h < NH, u < V: V vectors loaded once, one
// broadcast per head (both products below are sums of such rank-one updates).
template <int NH, int V>
[[gnu::always_inline]] inline void RankOneUpdate(__m512 (&acc)[NH][V], const float* a,
                                                 const float* b, int64_t stride) {
  __m512 av[V];
#pragma GCC unroll 4
  for (int u = 0; u < V; ++u) av[u] = _mm512_loadu_ps(a + 16 * u);
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    const __m512 bh = _mm512_set1_ps(b[h * stride]);
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) acc[h][u] = _mm512_fmadd_ps(bh, av[u], acc[h][u]);
  }
}

// s + h·kKeyTile as ScoreRow's s for the query at q + h·d, each row's max in mx[h].
template <int NH>
void ScoreRows(const float* q, const float* kt, int d, float scale, int n, float* s, float* mx) {
  __m512 acc[NH][kKeyVecs];
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v) acc[h][v] = _mm512_setzero_ps();
  }
  for (int x = 0; x < d; ++x) RankOneUpdate<NH, kKeyVecs>(acc, kt + x * kKeyTile, q + x, d);
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    float* sh = s + h * kKeyTile;
#pragma GCC unroll 4
    for (int v = 0; v < kKeyVecs; ++v) _mm512_storeu_ps(sh + 16 * v, _mm512_mul_ps(acc[h][v], sc));
    std::fill(sh + n, sh + kKeyTile, kNegInf);
    mx[h] = simd::Max(sh, kKeyTile);
  }
}

// a[h] += Σ_j p[h·kKeyTile + j] · v_j for h < NH over n contiguous value rows of d elements, d a
// multiple of 64: 64 columns at a time, every head's accumulators in registers.
template <int NH>
void WeightedValuesRows(const float* p, int n, const float* v, int d, float* const* a) {
  constexpr int kCols = 4;  // vectors: 64 columns
  for (int c = 0; c < d; c += 16 * kCols) {
    __m512 acc[NH][kCols];
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
      for (int u = 0; u < kCols; ++u) acc[h][u] = _mm512_loadu_ps(a[h] + c + 16 * u);
    }
    for (int j = 0; j < n; ++j) RankOneUpdate<NH, kCols>(acc, v + j * d + c, p + j, kKeyTile);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
      for (int u = 0; u < kCols; ++u) _mm512_storeu_ps(a[h] + c + 16 * u, acc[h][u]);
    }
  }
}
#endif

}  // namespace

void CpuPrefillAttention(const PrefillAttentionParams& p, ThreadPool& pool,
                         int64_t min_work_per_task) {
  const int group = p.n_heads / p.n_kv_heads;
  const int d = p.head_dim;
  const int queries = p.len - p.q_begin;
  const int64_t q_tiles = (queries + kQueryTile - 1) / kQueryTile;
  const int64_t tasks = q_tiles * p.n_kv_heads;
  // A task's multiply-adds, about: its query rows × the group × half the keys on average ×
  // 2·head_dim; short prompts of small models run on the calling thread.
  const int64_t work_per_task = std::max<int64_t>(
      1, int64_t{std::min(queries, kQueryTile)} * group * ((p.q_begin + p.len + 1) / 2) * 2 * d);
  const int window_start = p.len - p.window;
  pool.ParallelFor(
      tasks, std::max<int64_t>(1, min_work_per_task / work_per_task), [&](int64_t t0, int64_t t1) {
        const int rows_max = kQueryTile * group;
        std::vector<float> m(rows_max), l(rows_max), acc(int64_t{rows_max} * d);
        std::vector<float> kt(int64_t{d} * kKeyTile), vt(int64_t{d} * kKeyTile);
        std::vector<float> s(4 * kKeyTile);  // a tile's scores, of up to four heads
        // Query row i of head h (row `row` of the task's accumulators) meets a key tile whose
        // n raw scores are in s_h, their max tile_max: keeps the window's raw scores, rescales
        // the accumulated values and sum to the new max, and turns s_h into the tile's weights
        // (exp(s - m_new)). Returns the accumulators the weighted values go to.
        const auto update = [&](int i, int h, int row, int n, int j0, float* s_h, float tile_max) {
          if (p.window > 0 && i >= window_start) {  // raw scores, made probabilities below
            float* ws = p.window_scores + (int64_t{h} * p.window + (i - window_start)) * p.len;
            std::copy(s_h, s_h + n, ws + j0);
          }
          const float m_new = std::max(m[row], tile_max);
          const float correction = std::exp(m[row] - m_new);
          float* a = acc.data() + int64_t{row} * d;
          if (correction != 1.f) {
            for (int x = 0; x < d; ++x) a[x] *= correction;
          }
          const float sum = simd::ExpShiftSum(s_h, n, m_new);
          l[row] = l[row] * correction + sum;
          m[row] = m_new;
          return a;
        };
#if defined(__AVX512F__)
        // The group's heads four or two at a time where the shapes allow.
        const int together = d % 64 != 0 ? 1 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
#endif
        for (int64_t task = t0; task < t1; ++task) {
          // Interleave tiles from both ends so every chunk gets short and long rows.
          const int64_t qt_raw = task / p.n_kv_heads;
          const int64_t qt = (qt_raw % 2 == 0) ? qt_raw / 2 : q_tiles - 1 - qt_raw / 2;
          const int g = static_cast<int>(task % p.n_kv_heads);
          const int i0 = p.q_begin + static_cast<int>(qt * kQueryTile);
          const int i1 = std::min(p.len, i0 + kQueryTile);
          std::fill(m.begin(), m.end(), kNegInf);
          std::fill(l.begin(), l.end(), 0.f);
          std::fill(acc.begin(), acc.end(), 0.f);
          const float* kg = p.k + int64_t{g} * d;
          const float* vg = p.v + int64_t{g} * d;
          for (int j0 = 0; j0 < i1; j0 += kKeyTile) {
            const int j1 = std::min(i1, j0 + kKeyTile);
            TransposeKeyTile(kg + j0 * p.kv_stride, p.kv_stride, j1 - j0, d, kt.data());
            CopyValueTile(vg + j0 * p.kv_stride, p.kv_stride, j1 - j0, d, vt.data());
            for (int i = i0; i < i1; ++i) {
              const int n = std::min(j1, i + 1) - j0;  // causal: keys j0..i
              if (n <= 0) continue;
              const float* qi = p.q + i * p.q_stride + int64_t{g} * group * d;
              float* s0 = s.data();
#if defined(__AVX512F__)
              // NH heads of the group at a time (NH a compile-time 4 or 2).
              const auto heads = [&](auto nh) {
                constexpr int NH = decltype(nh)::value;
                for (int hg = 0; hg < group; hg += NH) {
                  float mx[NH];
                  float* a[NH];
                  ScoreRows<NH>(qi + hg * d, kt.data(), d, p.scale, n, s0, mx);
                  for (int u = 0; u < NH; ++u) {
                    a[u] = update(i, g * group + hg + u, (i - i0) * group + hg + u, n, j0,
                                  s0 + u * kKeyTile, mx[u]);
                  }
                  WeightedValuesRows<NH>(s0, n, vt.data(), d, a);
                }
              };
              if (together == 4) {
                heads(std::integral_constant<int, 4>{});
                continue;
              }
              if (together == 2) {
                heads(std::integral_constant<int, 2>{});
                continue;
              }
#endif
              for (int hg = 0; hg < group; ++hg) {
                const float tile_max = ScoreRow(qi + hg * d, kt.data(), d, p.scale, n, s0);
                float* a = update(i, g * group + hg, (i - i0) * group + hg, n, j0, s0, tile_max);
                WeightedValues(s0, n, vt.data(), d, a);
              }
            }
          }
          for (int i = i0; i < i1; ++i) {
            for (int hg = 0; hg < group; ++hg) {
              const int h = g * group + hg;
              const int row = (i - i0) * group + hg;
              float* o = p.out + i * p.out_stride + int64_t{h} * d;
              const float inv = 1.f / l[row];
              const float* a = acc.data() + int64_t{row} * d;
              for (int x = 0; x < d; ++x) o[x] = a[x] * inv;
              if (p.window > 0 && i >= window_start) {
                // Observation-window probabilities from the row's final max and sum.
                float* ws = p.window_scores + (int64_t{h} * p.window + (i - window_start)) * p.len;
                const float shift = m[row];
                simd::ExpShiftSum(ws, i + 1, shift);
                for (int j = 0; j <= i; ++j) ws[j] *= inv;
                std::fill(ws + i + 1, ws + p.len, 0.f);
              }
            }
          }
        }
      });
}

}  // namespace kvwire::kernels
