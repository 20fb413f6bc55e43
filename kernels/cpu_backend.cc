// The optimised CPU backend. What makes it fast, op by op:
//   MatMul     bf16 weights: x rounded to bf16, then register tiles of bf16 dot products
//              (AVX-512 BF16, 6 x rows × 4 W rows) over even panels of x whose stretch of
//              the rows (whole rows up to 4096, else about 2048) fits about 512 KiB, so L2;
//              W read once per panel, the next tile prefetched; one row of x streams W a
//              row at a time (kernels/gemm_few_rows.h). f32/f16 weights: up to 64 rows,
//              register tiles with f16 widened in registers; more rows, OpenBLAS sgemm per
//              thread on a slice of W (f16 slices widened to a thread-local float32 block).
//   Attention  prefill: flash-style tiles with an online softmax (Dao et al.), each key tile
//              transposed once so scores are vector accumulators and each value tile copied
//              contiguous, the query heads of a GQA group sharing both, four at a time in
//              AVX-512 registers (kernels/prefill_attention.h); decode reads each cached K/V
//              row once for the whole group.
// All parallelism comes from one ThreadPool; OpenBLAS runs single-threaded inside it.
#include "kernels/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/base/crc32c.h"
#include "common/base/status.h"
#include "kernels/cpu/decode_coded.h"
#include "kernels/cpu/selection.h"
#include "kernels/gemm_few_rows.h"
#include "kernels/host_memory.h"
#include "kernels/prefill_attention.h"
#include "kernels/reference_selection.h"
#include "kernels/simd.h"
#include "kernels/thread_pool.h"
#include "kernels/validate.h"

namespace kvwire::kernels {
namespace {

// Enough work per task that the fork-join costs (a few µs) stay in the noise.
constexpr int64_t kMinWorkPerTask = 1 << 15;

class CpuBackend final : public HostMemoryBackend {
 public:
  explicit CpuBackend(int threads) : pool_(threads) {
    // Our pool owns the cores; OpenBLAS runs inside its tasks.
    openblas_set_num_threads(1);
  }

  BackendKind kind() const override { return BackendKind::kCpu; }

  absl::Status MatMul(const MatMulParams& p) override {
    RETURN_IF_ERROR(ValidateMatMul(p));
    if (p.w_dtype == DType::kBF16) return MatMulBf16(p);
    return MatMulWidened(p);
  }

  // bf16 weights: x rounded to bf16 (kernels/backend.h), then bf16 dot products in panels
  // of rows whose bf16 copy stays in L2, or, without the instruction, the widened path on
  // the rounded x.
  absl::Status MatMulBf16(const MatMulParams& p) {
    const int64_t xs = p.x_stride ? p.x_stride : p.k;
    const int64_t ys = p.y_stride ? p.y_stride : p.n;
    const int64_t kp = (int64_t{p.k} + 31) / 32 * 32;
    // The caller's (prefill workers run at once); the pool's threads see it through `x16`.
    thread_local std::vector<uint16_t> xb;
    xb.resize(p.m * kp);
    uint16_t* x16 = xb.data();
    pool_.ParallelFor(p.m, std::max<int64_t>(1, kMinWorkPerTask / kp), [&](int64_t r0, int64_t r1) {
      RoundToBf16(p.x + r0 * xs, xs, static_cast<int>(r1 - r0), p.k, x16 + r0 * kp, kp);
    });
    if constexpr (!kHasBf16Dot) {
      thread_local std::vector<float> rounded;
      rounded.resize(p.m * kp);
      ToFloat(DType::kBF16, x16, rounded.data(), rounded.size());
      MatMulParams q = p;
      q.x = rounded.data();
      q.x_stride = kp;
      return MatMulWidened(q);
    }
    constexpr int64_t kTile = 4;
    const int64_t tiles = (p.n + kTile - 1) / kTile;
    // Panels of x rows whose bf16 stretch (the whole row up to 4096) fits about half an L2,
    // each stretch over every tile of W before the next (GemmBf16). Every panel reads all of
    // W: the rows are split evenly into as few panels as fit, each a whole number of GemmBf16's
    // passes (a last panel of a few rows would read W once more for almost nothing).
    const int stretch = Bf16Stretch(p.m, p.k);
    const int64_t sp = (int64_t{stretch} + 31) / 32 * 32;
    const int64_t most = std::max<int64_t>(kBf16PassRows, (int64_t{512} << 10) / (2 * sp));
    const int64_t panels = (p.m + most - 1) / most;
    const int panel = static_cast<int>(((p.m + panels - 1) / panels + kBf16PassRows - 1) /
                                       kBf16PassRows * kBf16PassRows);
    for (int r0 = 0; r0 < p.m; r0 += panel) {
      const int rows = std::min(panel, p.m - r0);
      for (int i0 = 0; i0 < p.k; i0 += stretch) {
        const int i1 = std::min(p.k, i0 + stretch);
        const int64_t grain =
            std::max<int64_t>(2, kMinWorkPerTask / (int64_t{i1 - i0} * rows * kTile));
        pool_.ParallelFor(tiles, grain, [&](int64_t t0, int64_t t1) {
          GemmBf16(x16 + r0 * kp, kp, rows, static_cast<const uint16_t*>(p.w), p.k, i0, i1,
                   t0 * kTile, std::min<int64_t>(p.n, t1 * kTile), p.bias, p.y + r0 * ys, ys);
        });
      }
    }
    return absl::OkStatus();
  }

  // f32 and f16 weights (and bf16 without the dot-product instruction).
  absl::Status MatMulWidened(const MatMulParams& p) {
    const int64_t xs = p.x_stride ? p.x_stride : p.k;
    const int64_t ys = p.y_stride ? p.y_stride : p.n;
    if (p.m <= kFewRowsMax) {
      // Tasks take whole tiles of weight rows.
      constexpr int64_t kTile = 4;
      const int64_t tiles = (p.n + kTile - 1) / kTile;
      const int64_t grain = std::max<int64_t>(2, kMinWorkPerTask / (int64_t{p.k} * p.m * kTile));
      pool_.ParallelFor(tiles, grain, [&](int64_t t0, int64_t t1) {
        GemmFewRows(p.x, xs, p.m, p.w, p.w_dtype, p.k, t0 * kTile,
                    std::min<int64_t>(p.n, t1 * kTile), p.bias, p.y, ys);
      });
      return absl::OkStatus();
    }
    // Slices of W rows sized so a widened float32 slice stays within about 2 MiB. The tasks
    // are sized by work, not by that bound: a small model's products (stories260K: k 64, n
    // 128-512) fit in one slice, and split by slices ran on one thread.
    const int64_t slice = std::max<int64_t>(16, (int64_t{1} << 19) / p.k);
    const int64_t grain = std::max<int64_t>(16, kMinWorkPerTask / (int64_t{p.m} * p.k));
    pool_.ParallelFor(p.n, grain, [&](int64_t j0, int64_t j1) {
      thread_local std::vector<float> wide;
      for (int64_t s0 = j0; s0 < j1; s0 += slice) {
        const int64_t s1 = std::min(j1, s0 + slice);
        const float* wf;
        if (p.w_dtype == DType::kF32) {
          wf = static_cast<const float*>(p.w) + s0 * p.k;
        } else {
          wide.resize((s1 - s0) * p.k);
          ToFloat(p.w_dtype, simd::Offset(p.w, p.w_dtype, s0 * p.k), wide.data(), wide.size());
          wf = wide.data();
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.m, static_cast<int>(s1 - s0), p.k,
                    1.f, p.x, static_cast<int>(xs), wf, p.k, 0.f, p.y + s0, static_cast<int>(ys));
        if (p.bias) {
          for (int r = 0; r < p.m; ++r) {
            for (int64_t j = s0; j < s1; ++j) p.y[r * ys + j] += p.bias[j];
          }
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const RmsNormParams& p) override {
    RETURN_IF_ERROR(ValidateRmsNorm(p));
    pool_.ParallelFor(p.rows, std::max<int64_t>(1, kMinWorkPerTask / p.dim),
                      [&](int64_t r0, int64_t r1) {
                        for (int64_t r = r0; r < r1; ++r) {
                          const float* x = p.x + r * p.dim;
                          float* y = p.y + r * p.dim;
                          if (p.residual) {  // the add, then the norm of the sum
                            float* res = p.residual + r * p.dim;
                            for (int i = 0; i < p.dim; ++i) res[i] += x[i];
                            x = res;
                          }
                          const float ss = simd::Dot(x, x, DType::kF32, p.dim);
                          const float inv = 1.f / std::sqrt(ss / p.dim + p.eps);
                          for (int i = 0; i < p.dim; ++i) y[i] = x[i] * inv * p.weight[i];
                        }
                      });
    return absl::OkStatus();
  }

  absl::Status Rope(const RopeParams& p) override {
    RETURN_IF_ERROR(ValidateRope(p));
    const int half = p.head_dim / 2;
    pool_.ParallelFor(p.rows, std::max<int64_t>(1, 4096 / (int64_t{p.heads} * half)),
                      [&](int64_t r0, int64_t r1) {
                        std::vector<float> cs(half), sn(half);
                        for (int64_t r = r0; r < r1; ++r) {
                          // One cos/sin table per row, shared by all heads.
                          for (int i = 0; i < half; ++i) {
                            const float angle = static_cast<float>(p.positions[r]) * p.inv_freq[i];
                            cs[i] = std::cos(angle);
                            sn[i] = std::sin(angle);
                          }
                          for (int h = 0; h < p.heads; ++h) {
                            float* x = p.x + r * p.row_stride + int64_t{h} * p.head_dim;
                            for (int i = 0; i < half; ++i) {
                              const float a = x[i], b = x[i + half];
                              x[i] = a * cs[i] - b * sn[i];
                              x[i + half] = b * cs[i] + a * sn[i];
                            }
                          }
                        }
                      });
    return absl::OkStatus();
  }

  absl::Status SwiGlu(const SwiGluParams& p) override {
    RETURN_IF_ERROR(ValidateSwiGlu(p));
    pool_.ParallelFor(
        p.rows, std::max<int64_t>(1, kMinWorkPerTask / p.ffn), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            const float* g = p.gate_up + r * 2 * p.ffn;
            const float* u = g + p.ffn;
            float* o = p.out + r * p.ffn;
            int i = 0;
#if KVWIRE_AVX2
            const __m256 one = _mm256_set1_ps(1.f);
            for (; i + 8 <= p.ffn; i += 8) {
              const __m256 gv = _mm256_loadu_ps(g + i);
              const __m256 e = simd::Exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
              _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                                    _mm256_loadu_ps(u + i)));
            }
#endif
            for (; i < p.ffn; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
          }
        });
    return absl::OkStatus();
  }

  absl::Status PrefillAttention(const PrefillAttentionParams& p) override;
  absl::Status DecodeAttention(const DecodeAttentionParams& p) override;

  void HostParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) override {
    pool_.ParallelFor(n, 1, fn);
  }

  // Selection compute: kernels/cpu/, one file per op. RunMeans and HbwSelect are the
  // reference's loops, rows in parallel (each row's work is small and sequential).
  absl::Status WindowVotes(const WindowVotesParams& p) override {
    RETURN_IF_ERROR(ValidateWindowVotes(p));
    cpu::WindowVotes(p, parallel_);
    return absl::OkStatus();
  }
  absl::Status Pool1d(const Pool1dParams& p) override {
    RETURN_IF_ERROR(ValidatePool1d(p));
    cpu::Pool1d(p, parallel_);
    return absl::OkStatus();
  }
  absl::Status RunMeans(const RunMeansParams& p) override {
    RETURN_IF_ERROR(ValidateRunMeans(p));
    const int runs = (p.n + p.run - 1) / p.run;
    pool_.ParallelFor(p.rows, 1, [&](int64_t r0, int64_t r1) {
      RunMeansParams part = p;
      part.x = p.x + r0 * p.n;
      part.y = p.y + r0 * runs;
      part.rows = static_cast<int>(r1 - r0);
      reference::RunMeans(part);
    });
    return absl::OkStatus();
  }
  absl::Status TopK(const TopKParams& p) override {
    RETURN_IF_ERROR(ValidateTopK(p));
    cpu::TopK(p, parallel_);
    return absl::OkStatus();
  }
  absl::Status HbwSelect(const HbwSelectParams& p) override {
    RETURN_IF_ERROR(ValidateHbwSelect(p));
    const int blocks = (p.prefix + p.block - 1) / p.block;
    pool_.ParallelFor(p.rows, 1, [&](int64_t r0, int64_t r1) {
      HbwSelectParams part = p;
      part.block_scores = p.block_scores + r0 * blocks;
      part.out = p.out + r0 * (p.prefix_budget + p.append);
      part.rows = static_cast<int>(r1 - r0);
      reference::HbwSelect(part);
    });
    return absl::OkStatus();
  }
  absl::Status GatherKv(const GatherKvParams& p) override {
    RETURN_IF_ERROR(ValidateGatherKv(p));
    cpu::GatherKv(p, parallel_);
    return absl::OkStatus();
  }
  absl::Status UpdateSummaries(const UpdateSummariesParams& p) override {
    RETURN_IF_ERROR(ValidateUpdateSummaries(p));
    cpu::UpdateSummaries(p, parallel_);
    return absl::OkStatus();
  }
  absl::Status PageScores(const PageScoresParams& p) override {
    RETURN_IF_ERROR(ValidatePageScores(p));
    cpu::PageScores(p, parallel_);
    return absl::OkStatus();
  }
  absl::Status Sample(const SampleParams& p) override {
    RETURN_IF_ERROR(ValidateSample(p));
    cpu::Sample(p, parallel_);
    return absl::OkStatus();
  }
  // SSE4.2's CRC instruction, spans in parallel.
  absl::Status ChecksumSpans(const ChecksumSpansParams& p) override {
    RETURN_IF_ERROR(ValidateChecksumSpans(p));
    parallel_(p.n, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        p.out[i] = Crc32c(p.spans[i].data, static_cast<size_t>(p.spans[i].bytes));
      }
    });
    return absl::OkStatus();
  }
  // memcpy per span, spans in parallel (a chunk's thousands of rows).
  absl::Status PackSpans(const PackSpansParams& p) override {
    RETURN_IF_ERROR(ValidatePackSpans(p));
    std::vector<int64_t> at(p.n + 1, 0);
    for (int i = 0; i < p.n; ++i) at[i + 1] = at[i] + p.spans[i].bytes;
    parallel_(p.n, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        if (p.spans[i].bytes == 0) continue;
        auto* span = const_cast<uint8_t*>(p.spans[i].data);
        const auto n = static_cast<size_t>(p.spans[i].bytes);
        if (p.unpack) {
          std::memcpy(span, p.packed + at[i], n);
        } else {
          std::memcpy(p.packed + at[i], span, n);
        }
      }
    });
    return absl::OkStatus();
  }

 private:
  ThreadPool pool_;
  const cpu::ParallelFn parallel_ = [this](int64_t n,
                                           const std::function<void(int64_t, int64_t)>& fn) {
    pool_.ParallelFor(n, 1, fn);
  };
};

// Flash-style prefill attention: kernels/prefill_attention.h.
absl::Status CpuBackend::PrefillAttention(const PrefillAttentionParams& p) {
  RETURN_IF_ERROR(ValidatePrefillAttention(p));
  CpuPrefillAttention(p, pool_, kMinWorkPerTask);
  return absl::OkStatus();
}

// Rows by index that decode attention asks for ahead of the one it reads (see below): enough
// to cover a miss to memory at the rate the key pass consumes rows (docs/benchmarks.md,
// "Decode at long context").
constexpr int kGatherAhead = 16;

// Decode attention: a task is (sequence, cache head). One pass over the keys scores all
// query heads of the group (each K row widened once), a vectorised softmax, then one pass
// over the values accumulates all heads' outputs (each V row widened once). Long caches
// make this a streaming read of K and V, so the point is to keep up with memory. The
// element type is a template parameter so the inner loops carry no dtype branches.
//
// A cache in one region reads head c's rows at c·head_stride + tok·d; a paged one looks each
// row up in its page table (kPaged, a template parameter so the region's loops are as they
// were: the lookup is per row, the rows of a page contiguous).
template <int G, DType T, bool kPaged>
void DecodeHeadGroup(const DecodeSequence& seq, int c, int d, float scale, float* s) {
  const int count = seq.indices ? seq.num_indices : seq.len;
  const int32_t* idx = seq.indices ? seq.indices + int64_t{c} * seq.num_indices : nullptr;
  const KvLayout& layout = seq.layout;
  const void* kbase = kPaged ? seq.k : simd::Offset(seq.k, T, c * layout.head_stride);
  const void* vbase = kPaged ? seq.v : simd::Offset(seq.v, T, c * layout.head_stride);
  // Token tok's row, in elements from kbase (or vbase).
  auto at = [&](int64_t tok) -> int64_t {
    if constexpr (kPaged) {
      return layout.Row(c, static_cast<int>(tok), d);
    } else {
      return tok * d;
    }
  };
  const float* q = seq.q + int64_t{c} * G * d;
  float* out = seq.out + int64_t{c} * G * d;
  constexpr int kVecs = G <= 4 ? 4 : 2;  // 8-float vectors per dimension block (pass 2)
  constexpr int kTile = 64;
#if KVWIRE_AVX2
  const bool vec = d % (8 * kVecs) == 0;
#else
  const bool vec = false;
#endif
  // Prefetches ahead of the vector passes. Rows in order (dense attention) are a stream of
  // short rows with work between, which the hardware prefetcher alone does not run far enough
  // ahead of: 8 rows ahead suffice. Rows by index (sparse attention) are short runs scattered
  // over the cache, each a wait on memory unless asked for well before: the key pass asks
  // for the key and the value of the row kGatherAhead ahead, from the first row on, so that
  // the value pass finds its rows in cache. (The selection has asked for all of them already,
  // at once, but a core drops prefetches while all its misses are outstanding.)
  const int ahead = idx ? kGatherAhead : 8;
  const int row_bytes = d * (T == DType::kF32 ? 4 : 2);
  auto prefetch_row = [&](const void* base, int64_t tok) {
    const char* row = static_cast<const char*>(simd::Offset(base, T, at(tok)));
    for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  };
  if (vec && idx) {
    for (int x = 0; x < std::min(ahead, count); ++x) {
      prefetch_row(kbase, idx[x]);
      prefetch_row(vbase, idx[x]);
    }
  }
  int x_start = 0;
#if KVWIRE_AVX2
  if (d == 8) {
    // Heads of 8 (the 260K-parameter model): 8 keys transposed in registers, so each query
    // head's 8 scores are one vector and no 8-lane sum is reduced per key.
    const __m256 vscale = _mm256_set1_ps(scale);
    for (; x_start + 8 <= count; x_start += 8) {
      __m256 r[8];
      for (int u = 0; u < 8; ++u) {
        const int64_t tok = idx ? idx[x_start + u] : x_start + u;
        r[u] = simd::LoadAs8<T>(simd::Offset(kbase, T, at(tok)), 0);
      }
      simd::Transpose8x8(r);  // r[i]: element i of the 8 keys
      for (int g = 0; g < G; ++g) {
        const float* qg = q + g * 8;
        __m256 a0 = _mm256_mul_ps(_mm256_broadcast_ss(qg), r[0]);
        __m256 a1 = _mm256_mul_ps(_mm256_broadcast_ss(qg + 1), r[1]);
        for (int i = 2; i < 8; i += 2) {
          a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(qg + i), r[i], a0);
          a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(qg + i + 1), r[i + 1], a1);
        }
        _mm256_storeu_ps(s + int64_t{g} * count + x_start,
                         _mm256_mul_ps(_mm256_add_ps(a0, a1), vscale));
      }
    }
  }
#endif
  for (int x = x_start; x < count; ++x) {
    const int64_t tok = idx ? idx[x] : x;
    const void* krow = simd::Offset(kbase, T, at(tok));
    if (vec) {
#if KVWIRE_AVX2
      if (x + ahead < count) {
        const int64_t next = idx ? idx[x + ahead] : x + ahead;
        prefetch_row(kbase, next);
        if (idx) prefetch_row(vbase, next);
      }
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      for (int i = 0; i < d; i += 8) {
        const __m256 kv = simd::LoadAs8<T>(krow, i);
        for (int g = 0; g < G; ++g)
          acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) s[int64_t{g} * count + x] = simd::HorizontalSum(acc[g]) * scale;
#endif
    } else {
      for (int g = 0; g < G; ++g)
        s[int64_t{g} * count + x] = simd::Dot(q + g * d, krow, T, d) * scale;
    }
  }
  for (int g = 0; g < G; ++g) {
    float* sh = s + int64_t{g} * count;
    const float mx = simd::Max(sh, count);
    const float inv = 1.f / simd::ExpShiftSum(sh, count, mx);
    for (int x = 0; x < count; ++x) sh[x] *= inv;
    std::fill(out + g * d, out + (g + 1) * d, 0.f);
  }
  // Values: tiles of tokens small enough to stay in L1, and for each tile blocks of head
  // dimensions whose outputs for all G heads fit in registers, so each V element is
  // widened and multiplied without an output load and store per token.
  bool values_done = false;
#if KVWIRE_AVX2
  if (d == 8) {
    // Each V row is one vector; two sets of accumulators (even and odd tokens) when they fit,
    // so consecutive tokens do not wait on each other's FMA.
    constexpr int kSets = G <= 4 ? 2 : 1;
    __m256 acc[kSets][G];
    for (int t = 0; t < kSets; ++t) {
      for (int g = 0; g < G; ++g) acc[t][g] = _mm256_setzero_ps();
    }
    int x = 0;
    for (; x + kSets <= count; x += kSets) {
      for (int t = 0; t < kSets; ++t) {
        const int64_t tok = idx ? idx[x + t] : x + t;
        const __m256 vv = simd::LoadAs8<T>(simd::Offset(vbase, T, at(tok)), 0);
        for (int g = 0; g < G; ++g) {
          acc[t][g] =
              _mm256_fmadd_ps(_mm256_broadcast_ss(s + int64_t{g} * count + x + t), vv, acc[t][g]);
        }
      }
    }
    for (; x < count; ++x) {
      const int64_t tok = idx ? idx[x] : x;
      const __m256 vv = simd::LoadAs8<T>(simd::Offset(vbase, T, at(tok)), 0);
      for (int g = 0; g < G; ++g) {
        acc[0][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + int64_t{g} * count + x), vv, acc[0][g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m256 sum = acc[0][g];
      for (int t = 1; t < kSets; ++t) sum = _mm256_add_ps(sum, acc[t][g]);
      _mm256_storeu_ps(out + g * 8, sum);
    }
    values_done = true;
  } else if (vec) {
    for (int x0 = 0; x0 < count; x0 += kTile) {
      const int x1 = std::min(count, x0 + kTile);
      for (int i0 = 0; i0 < d; i0 += 8 * kVecs) {
        __m256 acc[G][kVecs];
        for (int g = 0; g < G; ++g) {
          for (int j = 0; j < kVecs; ++j) acc[g][j] = _mm256_loadu_ps(out + g * d + i0 + 8 * j);
        }
        for (int x = x0; x < x1; ++x) {
          const int64_t tok = idx ? idx[x] : x;
          const void* vrow = simd::Offset(vbase, T, at(tok));
          if (i0 == 0 && x + ahead < count) prefetch_row(vbase, idx ? idx[x + ahead] : x + ahead);
          __m256 vv[kVecs];
          for (int j = 0; j < kVecs; ++j) vv[j] = simd::LoadAs8<T>(vrow, i0 + 8 * j);
          for (int g = 0; g < G; ++g) {
            const __m256 w = _mm256_set1_ps(s[int64_t{g} * count + x]);
            for (int j = 0; j < kVecs; ++j) acc[g][j] = _mm256_fmadd_ps(w, vv[j], acc[g][j]);
          }
        }
        for (int g = 0; g < G; ++g) {
          for (int j = 0; j < kVecs; ++j) _mm256_storeu_ps(out + g * d + i0 + 8 * j, acc[g][j]);
        }
      }
    }
    values_done = true;
  }
#endif
  if (!values_done) {
    std::vector<float> row(d);
    for (int x = 0; x < count; ++x) {
      const int64_t tok = idx ? idx[x] : x;
      const void* vrow = simd::Offset(vbase, T, at(tok));
      ToFloat(T, vrow, row.data(), d);
      for (int g = 0; g < G; ++g)
        simd::Axpy(s[int64_t{g} * count + x], row.data(), DType::kF32, out + g * d, d);
    }
  }
  if (seq.probs) {
    for (int g = 0; g < G; ++g) {
      float* probs = seq.probs + int64_t{c * G + g} * seq.len;
      std::fill(probs, probs + seq.len, 0.f);
      for (int x = 0; x < count; ++x) probs[idx ? idx[x] : x] = s[int64_t{g} * count + x];
    }
  }
}

template <int G, bool kPaged>
void DecodeHeadGroupOfType(const DecodeSequence& seq, int c, int d, DType t, float scale,
                           float* s) {
  switch (t) {
    case DType::kF32:
      return DecodeHeadGroup<G, DType::kF32, kPaged>(seq, c, d, scale, s);
    case DType::kBF16:
      return DecodeHeadGroup<G, DType::kBF16, kPaged>(seq, c, d, scale, s);
    case DType::kF16:
      return DecodeHeadGroup<G, DType::kF16, kPaged>(seq, c, d, scale, s);
  }
}

template <int G>
void DecodeHeadGroupAnyType(const DecodeSequence& seq, int c, int d, DType t, float scale,
                            float* s) {
  if (seq.layout.pages != nullptr) return DecodeHeadGroupOfType<G, true>(seq, c, d, t, scale, s);
  DecodeHeadGroupOfType<G, false>(seq, c, d, t, scale, s);
}

absl::Status CpuBackend::DecodeAttention(const DecodeAttentionParams& p) {
  RETURN_IF_ERROR(ValidateDecodeAttention(p));
  const int group = p.n_heads / p.n_cache_heads;
  const int64_t tasks = int64_t{p.batch} * p.n_cache_heads;
  // A task reads its group's keys and values once and multiplies each for every query head
  // of the group; small caches (a short context, a tiny model) run on the calling thread
  // rather than pay a fork-join per layer.
  int64_t rows = 0;
  for (int b = 0; b < p.batch; ++b) {
    rows += p.seqs[b].indices ? p.seqs[b].num_indices : p.seqs[b].len;
  }
  const int64_t work_per_task =
      std::max<int64_t>(1, rows * p.n_cache_heads * 2 * p.head_dim * group / tasks);
  pool_.ParallelFor(
      tasks, std::max<int64_t>(1, kMinWorkPerTask / work_per_task), [&](int64_t t0, int64_t t1) {
        // Kept across calls: a fresh multi-megabyte buffer per step would be fresh pages
        // (page faults and zeroing) every time.
        thread_local std::vector<float> s;
        for (int64_t task = t0; task < t1; ++task) {
          const DecodeSequence& seq = p.seqs[task / p.n_cache_heads];
          const int c = static_cast<int>(task % p.n_cache_heads);
          s.resize(int64_t{group} * (seq.indices ? seq.num_indices : seq.len));
          if (seq.coding.coded()) {
            cpu::DecodeHeadCoded(seq, c, group, p.head_dim, p.kv_dtype, p.scale, s.data());
            continue;
          }
          switch (group) {
            case 1:
              DecodeHeadGroupAnyType<1>(seq, c, p.head_dim, p.kv_dtype, p.scale, s.data());
              break;
            case 2:
              DecodeHeadGroupAnyType<2>(seq, c, p.head_dim, p.kv_dtype, p.scale, s.data());
              break;
            case 4:
              DecodeHeadGroupAnyType<4>(seq, c, p.head_dim, p.kv_dtype, p.scale, s.data());
              break;
            case 8:
              DecodeHeadGroupAnyType<8>(seq, c, p.head_dim, p.kv_dtype, p.scale, s.data());
              break;
            default:
              // Other group sizes: one query head at a time (as a group of one).
              for (int g = 0; g < group; ++g) {
                DecodeSequence one = seq;
                one.q = seq.q + int64_t{c * group + g} * p.head_dim - int64_t{c} * p.head_dim;
                one.out = seq.out + int64_t{c * group + g} * p.head_dim - int64_t{c} * p.head_dim;
                one.probs =
                    seq.probs ? seq.probs + int64_t{c * group + g} * seq.len - int64_t{c} * seq.len
                              : nullptr;
                DecodeHeadGroupAnyType<1>(one, c, p.head_dim, p.kv_dtype, p.scale, s.data());
              }
          }
        }
      });
  return absl::OkStatus();
}

}  // namespace

KernelBackendPtr MakeCpuBackend(int threads) { return std::make_unique<CpuBackend>(threads); }

}  // namespace kvwire::kernels
