// One generic test for every op on every backend against the reference backend (the
// specification), over a grid of shapes that includes awkward sizes (1, 7, 37, 733).
// Results must satisfy |a − r| ≤ atol + rtol·|r|; the first mismatches are printed.
// CUDA cases run only where a GPU is present and skip otherwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "kernels/backend.h"
#include "kernels/reference.h"
#include "tests/kernels/cuda_kernels_util.h"
#include "tests/kernels/ops_test_util.h"
#include "tests/test_util.h"
#if KVWIRE_HAVE_FLASHINFER
#include "kernels/cuda/flashinfer_decode.h"
#include "kernels/cuda/flashinfer_norm.h"
#include "kernels/cuda/flashinfer_prefill.h"
#endif

namespace kvwire::kernels {
namespace {

// Rows [heads, capacity, d] of a cache in one region laid out in pages of `page_tokens` tokens
// (KvLayout): page ids a random permutation of a pool with spare pages, pages a little further
// apart than their rows need, two heads a page where they pair up. Equal seeds, equal pages.
struct PagedRows {
  std::vector<float> rows;     // the pool
  std::vector<int32_t> table;  // the page table
  KvLayout layout;             // pages point into `table` (host memory, as ops take it)
};
PagedRows ToPages(const std::vector<float>& region, int heads, int capacity, int d, int page_tokens,
                  uint32_t seed) {
  PagedRows p;
  const int per_page = heads % 2 == 0 ? 2 : 1;
  const int blocks = (capacity + page_tokens - 1) / page_tokens;
  const int n_pages = blocks * (heads / per_page) + 3;
  const int64_t stride = int64_t{per_page} * page_tokens * d + 8;
  std::vector<int32_t> ids(n_pages);
  for (int i = 0; i < n_pages; ++i) ids[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.table.assign(ids.begin(), ids.begin() + int64_t{blocks} * (heads / per_page));
  p.rows = Random(static_cast<size_t>(n_pages) * stride, seed + 1);  // what no row overwrites
  p.layout.page_tokens = page_tokens;
  p.layout.heads_per_page = per_page;
  p.layout.n_heads = heads;
  p.layout.page_stride = stride;
  p.layout.pages = p.table.data();
  for (int c = 0; c < heads; ++c) {
    for (int t = 0; t < capacity; ++t) {
      std::copy_n(region.begin() + (int64_t{c} * capacity + t) * d, d,
                  p.rows.begin() + p.layout.Row(c, t, d));
    }
  }
  return p;
}

int64_t FlashInferPrefillLaunchesHere() {
#if KVWIRE_HAVE_FLASHINFER
  return cuda::FlashInferPrefillLaunches();
#else
  return 0;
#endif
}
int64_t FlashInferNormLaunchesHere() {
#if KVWIRE_HAVE_FLASHINFER
  return cuda::FlashInferNormLaunches();
#else
  return 0;
#endif
}
// The window's scores as a cuBLAS product (where FlashInfer ran the prefill), calls so far.
int64_t WindowScoreLaunchesHere() {
#if KVWIRE_HAVE_FLASHINFER
  return cuda::WindowScoreLaunches();
#else
  return 0;
#endif
}
// FA3's prefill calls so far.
int64_t FlashInferFa3LaunchesHere() {
#if KVWIRE_HAVE_FLASHINFER
  return cuda::FlashInferFa3PrefillLaunches();
#else
  return 0;
#endif
}
// Whether the CUDA backend sends the decode calls FlashInfer serves there (not where
// $KVWIRE_CUDA_ATTENTION=native keeps them on kvwire's kernel).
bool CudaDecodesThroughFlashInfer() {
#if KVWIRE_HAVE_FLASHINFER
  return CudaAttentionChoice() != "native";
#else
  return false;
#endif
}
// Whether a bf16 prefill on this GPU goes to FA3: built for an sm_90 device, and
// $KVWIRE_CUDA_ATTENTION neither native nor flashinfer-fa2.
bool CudaPrefillsThroughFa3() {
#if KVWIRE_HAVE_FLASHINFER
  return CudaDecodesThroughFlashInfer() && CudaAttentionChoice() != "flashinfer-fa2" &&
         cuda::FlashInferFa3Serves();
#else
  return false;
#endif
}

// ---------------------------------------------------------------- MatMul

struct MatMulCase {
  int m, n, k;
  DType dtype;
  bool bias;
  int x_pad = 0, y_pad = 0;
};

std::vector<float> RunMatMul(KernelBackend& b, const MatMulCase& c, const std::vector<float>& x,
                             const std::vector<uint8_t>& w, const std::vector<float>& bias) {
  Arena a(b);
  MatMulParams p;
  p.m = c.m;
  p.n = c.n;
  p.k = c.k;
  p.x = a.Upload(x);
  p.x_stride = c.k + c.x_pad;
  p.w = a.Upload(w);
  p.w_dtype = c.dtype;
  p.bias = c.bias ? a.Upload(bias) : nullptr;
  p.y_stride = c.n + c.y_pad;
  const size_t ny = static_cast<size_t>(c.m) * p.y_stride;
  p.y = a.Zeros(ny);
  const absl::Status st = b.MatMul(p);
  EXPECT_TRUE(st.ok()) << st;
  return a.Download(p.y, ny);
}

TEST_P(BackendOpsTest, MatMul) {
  std::vector<MatMulCase> cases;
  // Odd sizes around the CPU backend's register tiles (4 weight rows x up to 4 activation
  // rows, 8 or 16 lanes), its one-row kernel (64 elements a step, then up to two 32-element
  // vectors, the last masked), its switch to OpenBLAS above 64 rows, and bf16 rows longer than
  // 4096 (taken in stretches, the last one ending in a masked vector; one row of x: whole rows).
  const std::vector<std::tuple<int, int, int>> shapes = {
      {1, 1, 1},     {1, 7, 37},    {1, 37, 733},  {1, 9, 96},   {1, 6, 128},  {2, 37, 733},
      {3, 733, 37},  {4, 64, 64},   {5, 9, 48},    {6, 10, 17},  {7, 33, 100}, {16, 37, 733},
      {17, 37, 733}, {33, 11, 129}, {37, 64, 128}, {63, 13, 50}, {64, 1, 7},   {64, 6, 33},
      {65, 37, 100}, {1, 5, 8200},  {5, 9, 4133},  {70, 6, 6000}};
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [m, n, k] : shapes) {
      cases.push_back({m, n, k, t, false});
      cases.push_back({m, n, k, t, true, 3, 5});
    }
  }
  uint32_t seed = 1;
  for (const MatMulCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("m=", c.m, " n=", c.n, " k=", c.k, " dtype=", DTypeName(c.dtype),
                              " bias=", c.bias, " padded=", c.x_pad > 0));
    const auto x = Random(static_cast<size_t>(c.m) * (c.k + c.x_pad), seed++);
    const auto w = Encode(Random(static_cast<size_t>(c.n) * c.k, seed++), c.dtype);
    const auto bias = Random(c.n, seed++);
    const auto want = RunMatMul(*reference_, c, x, w, bias);
    const auto got = RunMatMul(*backend_, c, x, w, bias);
    // float32 sums of k products whose result cancels to near zero: the absolute error grows
    // with k (the reference sums in another order).
    EXPECT_TRUE(AllClose(got, want, {1e-5f * std::max(1.f, c.k / 512.f), 2e-4f}));
  }
}

// bf16 weights multiply x rounded to bf16 (backend.h): 1 + 2^-10 is not a bf16 value (7
// mantissa bits) and rounds to 1, so with bf16 ones as W the sum of 64 such x is exactly 64;
// with float32 ones it keeps the 2^-10 of each. Every backend, the reference included.
TEST_P(BackendOpsTest, Bf16WeightsMultiplyXRoundedToBf16) {
  // One row (on CUDA, the GEMV rounds x) and three (cuBLAS's rows, rounded before the product).
  for (int m : {1, 3}) {
    SCOPED_TRACE(absl::StrCat("m=", m));
    MatMulCase c{m, 5, 64, DType::kBF16, false};
    const std::vector<float> x(static_cast<size_t>(c.m) * c.k, 1.f + 0x1p-10f);
    const std::vector<float> ones(static_cast<size_t>(c.n) * c.k, 1.f);
    for (KernelBackend* b : {backend_.get(), reference_.get()}) {
      c.dtype = DType::kBF16;
      for (float y : RunMatMul(*b, c, x, Encode(ones, c.dtype), {})) EXPECT_EQ(y, 64.f);
      c.dtype = DType::kF32;
      for (float y : RunMatMul(*b, c, x, Encode(ones, c.dtype), {})) {
        EXPECT_FLOAT_EQ(y, 64.f * (1.f + 0x1p-10f));
      }
    }
  }
}

// ---------------------------------------------------------------- AppendKv

// Each sequence's new rows land at its own token of every cache head, in the cache's dtype
// (bit for bit: one rounding), and nothing else of the cache changes.
TEST_P(BackendOpsTest, AppendKv) {
  uint32_t seed = 70;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (auto [kv_heads, cache_heads] : std::vector<std::pair<int, int>>{{1, 1}, {2, 2}, {2, 8}}) {
      for (int d : {8, 64, 128, 300}) {
        SCOPED_TRACE(
            absl::StrCat("dtype=", DTypeName(t), " heads=", kv_heads, "/", cache_heads, " d=", d));
        const int batch = 3, capacity = 9;
        const int64_t hs = int64_t{capacity} * d;
        const size_t cache_bytes = cache_heads * hs * DTypeSize(t);
        std::vector<std::vector<float>> ks, vs;
        std::vector<std::vector<uint8_t>> kc, vc;
        for (int b = 0; b < batch; ++b) {
          ks.push_back(Random(kv_heads * d, seed++, -3.f, 3.f));
          vs.push_back(Random(kv_heads * d, seed++, -3.f, 3.f));
          kc.push_back(Encode(Random(cache_heads * hs, seed++), t));
          vc.push_back(Encode(Random(cache_heads * hs, seed++), t));
        }
        auto run = [&](KernelBackend& be) {
          Arena a(be);
          std::vector<KvAppend> seqs(batch);
          for (int b = 0; b < batch; ++b) {
            seqs[b] = {a.Upload(ks[b]),   a.Upload(vs[b]),      a.Upload(kc[b]),
                       a.Upload(vc[b]),   KvLayout::Region(hs), {},
                       (b * 4) % capacity};
          }
          AppendKvParams p{seqs.data(), batch, kv_heads, cache_heads, d, t};
          const absl::Status st = be.AppendKv(p);
          EXPECT_TRUE(st.ok()) << st;
          std::vector<uint8_t> all;
          for (const KvAppend& s : seqs) {
            for (const void* c : {s.k_cache, s.v_cache}) {
              const auto bytes = a.DownloadBytes(c, cache_bytes);
              all.insert(all.end(), bytes.begin(), bytes.end());
            }
          }
          return all;
        };
        const auto got = run(*backend_);
        const auto want = run(*reference_);
        EXPECT_EQ(got, want);
        // The reference itself: sequence 1's token 4 of its last cache head holds its last KV
        // head's K row, and its token 5 is untouched.
        std::vector<uint8_t> row(d * DTypeSize(t));
        FromFloat(t, ks[1].data() + (kv_heads - 1) * d, row.data(), d);
        const size_t seq1 = 2 * cache_bytes;
        const size_t at = seq1 + ((cache_heads - 1) * hs + 4 * d) * DTypeSize(t);
        EXPECT_TRUE(std::equal(row.begin(), row.end(), want.begin() + at));
        const size_t next = at + row.size();
        EXPECT_TRUE(std::equal(kc[1].begin() + (next - seq1),
                               kc[1].begin() + (next - seq1) + row.size(), want.begin() + next));
      }
    }
  }
}

TEST_P(BackendOpsTest, AppendKvRejectsATokenPastTheCache) {
  Arena a(*backend_);
  float* row = a.Zeros(16);
  float* cache = a.Zeros(16 * 4);
  KvAppend s{row, row, cache, cache, KvLayout::Region(16), {}, /*t=*/1};  // room for token 0 only
  AppendKvParams p{&s, 1, 1, 1, 16, DType::kF32};
  const absl::Status st = backend_->AppendKv(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("2 tokens do not fit a head_stride of 16"), std::string::npos) << st;
}

// ---------------------------------------------------------------- RmsNorm, Rope, SwiGlu

TEST_P(BackendOpsTest, RmsNorm) {
  uint32_t seed = 100;
  for (int rows : {1, 7, 37}) {
    for (int dim : {1, 7, 37, 733}) {
      SCOPED_TRACE(absl::StrCat("rows=", rows, " dim=", dim));
      const auto x = Random(static_cast<size_t>(rows) * dim, seed++, -3.f, 3.f);
      const auto w = Random(dim, seed++, 0.5f, 1.5f);
      auto run = [&](KernelBackend& b) {
        Arena a(b);
        RmsNormParams p{a.Upload(x), a.Upload(w), a.Zeros(x.size()), rows, dim, 1e-5f};
        EXPECT_TRUE(b.RmsNorm(p).ok());
        return a.Download(p.y, x.size());
      };
      EXPECT_TRUE(AllClose(run(*backend_), run(*reference_), {1e-5f, 1e-4f}));
    }
  }
}

// The residual add fused into the norm: residual += x, y = the norm of the sum; in place (y is
// x, as the model calls it, and as FlashInfer's FusedAddRMSNorm serves rows of a whole number
// of 16-byte vectors on a GPU) and into another buffer.
TEST_P(BackendOpsTest, RmsNormWithResidual) {
  uint32_t seed = 150;
  for (int rows : {1, 7, 37}) {
    for (int dim : {1, 7, 64, 733, 2048}) {
      for (bool in_place : {true, false}) {
        SCOPED_TRACE(absl::StrCat("rows=", rows, " dim=", dim, " in_place=", in_place));
        const size_t n = static_cast<size_t>(rows) * dim;
        const auto x = Random(n, seed++, -3.f, 3.f);
        const auto res = Random(n, seed++, -3.f, 3.f);
        const auto w = Random(dim, seed++, 0.5f, 1.5f);
        auto run = [&](KernelBackend& b, std::vector<float>* residual) {
          Arena a(b);
          float* xd = a.Upload(x);
          RmsNormParams p{xd, a.Upload(w), in_place ? xd : a.Zeros(n), rows, dim, 1e-5f};
          p.residual = a.Upload(res);
          const absl::Status st = b.RmsNorm(p);
          EXPECT_TRUE(st.ok()) << st;
          *residual = a.Download(p.residual, n);
          return a.Download(p.y, n);
        };
        const int64_t before = FlashInferNormLaunchesHere();
        std::vector<float> got_res, want_res;
        const std::vector<float> got = run(*backend_, &got_res);
        const bool library = FlashInferNormLaunchesHere() > before;
        const std::vector<float> want = run(*reference_, &want_res);
        EXPECT_TRUE(AllClose(got, want, {1e-5f, 1e-4f}));
        EXPECT_TRUE(AllClose(got_res, want_res, {0.f, 0.f}));  // one f32 add each: exact
        if (GetParam() == BackendKind::kCuda) {
          EXPECT_EQ(library, FlashInferBuilt() && in_place && dim % 4 == 0);
        }
      }
    }
  }
  // Rows off a 16-byte boundary (x one float into its buffer): kvwire's kernel on a GPU, the
  // same results.
  {
    const int rows = 3, dim = 64;
    const size_t n = static_cast<size_t>(rows) * dim;
    const auto x = Random(n + 1, 170, -3.f, 3.f);
    const auto res = Random(n, 171, -3.f, 3.f);
    const auto w = Random(dim, 172, 0.5f, 1.5f);
    auto run = [&](KernelBackend& b, std::vector<float>* residual) {
      Arena a(b);
      float* xd = a.Upload(x) + 1;
      RmsNormParams p{xd, a.Upload(w), xd, rows, dim, 1e-5f};
      p.residual = a.Upload(res);
      EXPECT_TRUE(b.RmsNorm(p).ok());
      *residual = a.Download(p.residual, n);
      return a.Download(p.y, n);
    };
    const int64_t before = FlashInferNormLaunchesHere();
    std::vector<float> got_res, want_res;
    const std::vector<float> got = run(*backend_, &got_res);
    EXPECT_EQ(FlashInferNormLaunchesHere(), before);
    EXPECT_TRUE(AllClose(got, run(*reference_, &want_res), {1e-5f, 1e-4f}));
    EXPECT_TRUE(AllClose(got_res, want_res, {0.f, 0.f}));
  }
  // A residual sharing rows with x or y is refused, naming the op.
  Arena a(*backend_);
  float* buf = a.Zeros(64);
  const float* w = a.Upload(std::vector<float>(8, 1.f));
  RmsNormParams p{buf, w, buf + 32, 2, 8, 1e-5f};
  p.residual = buf + 8;
  const absl::Status st = backend_->RmsNorm(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("RmsNorm: residual must overlap neither x nor y"), std::string::npos)
      << st;
}

TEST_P(BackendOpsTest, Rope) {
  uint32_t seed = 200;
  for (int rows : {1, 7, 37}) {
    for (int heads : {1, 3}) {
      for (int head_dim : {2, 8, 64, 128}) {
        SCOPED_TRACE(absl::StrCat("rows=", rows, " heads=", heads, " head_dim=", head_dim));
        const int64_t stride = int64_t{heads} * head_dim + 5;
        const auto x = Random(static_cast<size_t>(rows) * stride, seed++);
        std::vector<int32_t> pos(rows);
        std::mt19937 rng(seed++);
        for (int32_t& p : pos) p = static_cast<int32_t>(rng() % 20000);
        std::vector<float> inv(head_dim / 2);
        for (int i = 0; i < head_dim / 2; ++i) {
          inv[i] = 1.f / std::pow(10000.f, 2.f * i / head_dim);
        }
        auto run = [&](KernelBackend& b) {
          Arena a(b);
          RopeParams p{a.Upload(x), stride, a.Upload(pos), a.Upload(inv), rows, heads, head_dim};
          EXPECT_TRUE(b.Rope(p).ok());
          return a.Download(p.x, x.size());
        };
        // Large angles: sin/cos implementations may differ in the last bits.
        EXPECT_TRUE(AllClose(run(*backend_), run(*reference_), {2e-4f, 1e-4f}));
      }
    }
  }
}

TEST_P(BackendOpsTest, SwiGlu) {
  uint32_t seed = 300;
  for (int rows : {1, 7, 37}) {
    for (int ffn : {1, 7, 733}) {
      SCOPED_TRACE(absl::StrCat("rows=", rows, " ffn=", ffn));
      const auto gu = Random(static_cast<size_t>(rows) * 2 * ffn, seed++, -6.f, 6.f);
      auto run = [&](KernelBackend& b) {
        Arena a(b);
        SwiGluParams p{a.Upload(gu), a.Zeros(static_cast<size_t>(rows) * ffn), rows, ffn};
        EXPECT_TRUE(b.SwiGlu(p).ok());
        return a.Download(p.out, static_cast<size_t>(rows) * ffn);
      };
      EXPECT_TRUE(AllClose(run(*backend_), run(*reference_), {1e-5f, 1e-5f}));
    }
  }
}

// ---------------------------------------------------------------- PrefillAttention

// One PrefillAttention on `b` over the host rows of `c` (q rows qs floats apart, k and v rows kvs;
// out rows qs apart, each float starting as c.fill): the outputs, and the window's scores into
// *scores when there is a window.
struct PrefillCase {
  std::vector<float> q, k, v;
  int64_t qs = 0, kvs = 0;
  int len = 0, heads = 0, kv_heads = 0, d = 0, window = 0, q_begin = 0;
  float scale = 0.f, fill = 0.f;
  DType precision = DType::kF32;
};
// Random rows for `len` tokens: q and k uniform in [-range, range], v in [-1, 1], each k and v
// row kv_pad floats longer than its heads; the scale 1/√d. Draws q, k, v from *seed on.
PrefillCase RandomPrefillCase(int len, int heads, int kv_heads, int d, int kv_pad, float range,
                              uint32_t* seed) {
  PrefillCase c;
  c.qs = int64_t{heads} * d;
  c.kvs = int64_t{kv_heads} * d + kv_pad;
  c.q = Random(len * c.qs, (*seed)++, -range, range);
  c.k = Random(len * c.kvs, (*seed)++, -range, range);
  c.v = Random(len * c.kvs, (*seed)++);
  c.len = len;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.d = d;
  c.scale = 1.f / std::sqrt(static_cast<float>(d));
  return c;
}

std::vector<float> RunPrefill(KernelBackend& b, const PrefillCase& c, std::vector<float>* scores) {
  Arena a(b);
  PrefillAttentionParams p;
  p.q = a.Upload(c.q);
  p.k = a.Upload(c.k);
  p.v = a.Upload(c.v);
  p.q_stride = p.out_stride = c.qs;
  p.kv_stride = c.kvs;
  p.out = a.Upload(std::vector<float>(c.len * c.qs, c.fill));
  p.len = c.len;
  p.q_begin = c.q_begin;
  p.n_heads = c.heads;
  p.n_kv_heads = c.kv_heads;
  p.head_dim = c.d;
  p.scale = c.scale;
  p.precision = c.precision;
  p.window = c.window;
  const size_t ns = static_cast<size_t>(c.heads) * c.window * c.len;
  p.window_scores = c.window ? a.Zeros(ns) : nullptr;
  const absl::Status st = b.PrefillAttention(p);
  EXPECT_TRUE(st.ok()) << st;
  if (c.window) *scores = a.Download(p.window_scores, ns);
  return a.Download(p.out, c.len * c.qs);
}

TEST_P(BackendOpsTest, PrefillAttention) {
  uint32_t seed = 400;
  for (int len : {1, 7, 37, 133}) {
    for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{1, 1}, {4, 2}, {8, 1}}) {
      for (int d : {8, 16, 32, 37, 64, 128}) {
        for (int window : {0, 1, 7, len}) {
          if (window > len) continue;
          SCOPED_TRACE(absl::StrCat("len=", len, " heads=", heads, "/", kv_heads, " d=", d,
                                    " window=", window));
          PrefillCase c = RandomPrefillCase(len, heads, kv_heads, d, 3, 2.f, &seed);
          c.window = window;
          auto run = [&](KernelBackend& b, std::vector<float>* scores) {
            return RunPrefill(b, c, scores);
          };
          std::vector<float> s_got, s_want;
          const auto got = run(*backend_, &s_got);
          const auto want = run(*reference_, &s_want);
          EXPECT_TRUE(AllClose(got, want, {2e-5f, 2e-4f}));
          EXPECT_TRUE(AllClose(s_got, s_want, {1e-6f, 2e-4f}));
        }
      }
    }
  }
}

// A bf16 model's prefill attention (precision bf16): on cuda, FlashInfer's single prefill over
// q, k and v rounded to bf16, its outputs held to bf16's rounding, and the window's scores a
// cuBLAS product in f32 (as exact as the reference's); elsewhere f32, as the reference. From a
// row too (a cached prefix), and with head dims FlashInfer is not built for (kvwire's kernel).
TEST_P(BackendOpsTest, PrefillAttentionInBf16) {
  uint32_t seed = 480;
  for (int len : {1, 37, 300}) {
    for (auto [heads, kv_heads] : std::vector<std::pair<int, int>>{{8, 2}, {4, 4}, {8, 1}}) {
      for (int d : {32, 64, 128}) {
        for (int q_begin : {0, len / 2}) {
          for (int window : {0, std::min(len - q_begin, 8)}) {
            SCOPED_TRACE(absl::StrCat("len=", len, " heads=", heads, "/", kv_heads, " d=", d,
                                      " q_begin=", q_begin, " window=", window));
            PrefillCase c = RandomPrefillCase(len, heads, kv_heads, d, 2, 1.f, &seed);
            c.q_begin = q_begin;
            c.precision = DType::kBF16;
            c.window = window;
            auto run = [&](KernelBackend& b, std::vector<float>* scores) {
              return RunPrefill(b, c, scores);
            };
            std::vector<float> s_got, s_want;
            const int64_t before = FlashInferPrefillLaunchesHere();
            const int64_t fa3_before = FlashInferFa3LaunchesHere();
            const int64_t scores_before = WindowScoreLaunchesHere();
            const auto got = run(*backend_, &s_got);
            const bool library = FlashInferPrefillLaunchesHere() > before;
            const bool fa3 = FlashInferFa3LaunchesHere() > fa3_before;
            // FlashInfer returns no probabilities: the window's are a cuBLAS product then.
            EXPECT_EQ(WindowScoreLaunchesHere() > scores_before, library && window > 0);
            const auto want = run(*reference_, &s_want);
            EXPECT_EQ(library, GetParam() == BackendKind::kCuda && CudaDecodesThroughFlashInfer() &&
                                   d != 32);
            EXPECT_EQ(fa3, library && CudaPrefillsThroughFa3());
            // bf16 inputs and outputs: a few units in the 9th bit of values within [-1, 1].
            EXPECT_TRUE(AllClose(got, want,
                                 library ? Tolerance{1.5e-2f, 1.5e-2f} : Tolerance{2e-5f, 2e-4f}));
            EXPECT_TRUE(AllClose(s_got, s_want, {1e-6f, 2e-4f}));
            // Rows before q_begin are not written, whichever kernel ran.
            for (int64_t i = 0; i < int64_t{q_begin} * c.qs; ++i) ASSERT_EQ(got[i], 0.f) << i;
          }
        }
      }
    }
  }
}

// Queries from row q_begin only (a prompt whose first rows' keys came from a prefix cache):
// each row computed is the same, bit for bit, as in the pass over every row on the same
// backend, and the rows before it are not written; the window must lie after q_begin.
TEST_P(BackendOpsTest, PrefillAttentionFromARow) {
  uint32_t seed = 450;
  for (int len : {40, 133}) {
    for (int q_begin : {1, 16, 37, len - 1}) {
      for (int window : {0, 1, std::min(len - q_begin, 8)}) {
        SCOPED_TRACE(absl::StrCat("len=", len, " q_begin=", q_begin, " window=", window));
        const int heads = 4, kv_heads = 2, d = 64;
        PrefillCase c = RandomPrefillCase(len, heads, kv_heads, d, 0, 2.f, &seed);
        c.scale = 0.125f;
        const int64_t qs = c.qs;
        c.window = window;
        c.fill = 7.f;
        auto run = [&](KernelBackend& b, int from, std::vector<float>* scores) {
          PrefillCase f = c;
          f.q_begin = from;
          return RunPrefill(b, f, scores);
        };
        std::vector<float> s_all, s_from, s_ref;
        const auto all = run(*backend_, 0, &s_all);
        const auto from = run(*backend_, q_begin, &s_from);
        for (int64_t x = 0; x < len * qs; ++x) {
          if (x < q_begin * qs) {
            ASSERT_EQ(from[x], 7.f) << "row " << x / qs << " was written";
          } else {
            ASSERT_EQ(from[x], all[x]) << "row " << x / qs;
          }
        }
        EXPECT_EQ(s_from, s_all);
        const auto ref = run(*reference_, q_begin, &s_ref);
        EXPECT_TRUE(AllClose(from, ref, {2e-5f, 2e-4f}));
      }
    }
  }
  // A window reaching before q_begin, and q_begin outside the rows.
  Arena a(*backend_);
  PrefillAttentionParams p;
  p.q = p.k = p.v = a.Zeros(64);
  p.out = a.Zeros(64);
  p.q_stride = p.kv_stride = p.out_stride = 8;
  p.len = 8;
  p.n_heads = p.n_kv_heads = 1;
  p.head_dim = 8;
  p.scale = 1.f;
  p.q_begin = 6;
  p.window = 3;
  p.window_scores = a.Zeros(24);
  EXPECT_EQ(backend_->PrefillAttention(p).code(), absl::StatusCode::kInvalidArgument);
  p.window = 0;
  p.q_begin = 8;
  EXPECT_EQ(backend_->PrefillAttention(p).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(BackendOpsTest, PrefillWindowScoresAreRowSoftmaxes) {
  // Each window row is a probability distribution over keys 0..i and zero after.
  const int len = 37, heads = 4, kv = 2, d = 16, window = 7;
  const auto q = Random(len * heads * d, 7, -2.f, 2.f);
  const auto k = Random(len * kv * d, 8, -2.f, 2.f);
  const auto v = Random(len * kv * d, 9);
  Arena a(*backend_);
  PrefillAttentionParams p;
  p.q = a.Upload(q);
  p.k = a.Upload(k);
  p.v = a.Upload(v);
  p.q_stride = heads * d;
  p.kv_stride = kv * d;
  p.out_stride = heads * d;
  p.out = a.Zeros(len * heads * d);
  p.len = len;
  p.n_heads = heads;
  p.n_kv_heads = kv;
  p.head_dim = d;
  p.scale = 0.25f;
  p.window = window;
  p.window_scores = a.Zeros(heads * window * len);
  ASSERT_TRUE(backend_->PrefillAttention(p).ok());
  const auto s = a.Download(p.window_scores, heads * window * len);
  for (int h = 0; h < heads; ++h) {
    for (int r = 0; r < window; ++r) {
      const int i = len - window + r;
      double sum = 0;
      for (int j = 0; j < len; ++j) {
        const float x = s[(h * window + r) * len + j];
        if (j > i) {
          EXPECT_EQ(x, 0.f) << "h=" << h << " row " << i << " key " << j;
        } else {
          EXPECT_GT(x, 0.f);
        }
        sum += x;
      }
      EXPECT_NEAR(sum, 1.0, 1e-5) << "h=" << h << " row " << i;
    }
  }
}

// ---------------------------------------------------------------- EmbedRows

TEST_P(BackendOpsTest, EmbedRows) {
  uint32_t seed = 950;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int hidden : {1, 64, 1000}) {
      SCOPED_TRACE(absl::StrCat("dtype=", DTypeName(t), " hidden=", hidden));
      const int vocab = 37;
      const std::vector<float> table = Random(int64_t{vocab} * hidden, seed++);
      const std::vector<int32_t> ids = {0, 36, 5, 5, 17, 1};
      auto run = [&](KernelBackend& b) {
        Arena a(b);
        EmbedRowsParams p;
        p.table = a.Upload(Encode(table, t));
        p.dtype = t;
        p.vocab = vocab;
        p.hidden = hidden;
        p.ids = ids.data();
        p.n = static_cast<int>(ids.size());
        p.out = a.Zeros(ids.size() * hidden);
        EXPECT_TRUE(b.EmbedRows(p).ok());
        return a.Download(p.out, ids.size() * hidden);
      };
      const auto got = run(*backend_);
      EXPECT_EQ(got, run(*reference_));  // a widening: exact
      // Row 2 is the table's row 5, whatever the dtype rounded it to.
      const auto want = run(*reference_);
      EXPECT_EQ(std::vector<float>(got.begin() + 2 * hidden, got.begin() + 3 * hidden),
                std::vector<float>(want.begin() + 3 * hidden, want.begin() + 4 * hidden));
    }
  }
  // An id outside the vocabulary is refused, naming it, before anything is read.
  Arena a(*backend_);
  EmbedRowsParams p;
  p.table = a.Zeros(8);
  p.vocab = 2;
  p.hidden = 4;
  const std::vector<int32_t> bad = {1, 2};
  p.ids = bad.data();
  p.n = 2;
  p.out = a.Zeros(8);
  const absl::Status st = backend_->EmbedRows(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("ids[1] = 2"), std::string::npos) << st;
}

// ---------------------------------------------------------------- DecodeAttention

// One DecodeAttention call over the batch `seqs` at the scale 1/√d, which must succeed.
void RunDecodeAttention(KernelBackend& b, const std::vector<DecodeSequence>& seqs, int heads,
                        int cache_heads, int d, DType t) {
  const absl::Status st =
      b.DecodeAttention({seqs.data(), static_cast<int>(seqs.size()), heads, cache_heads, d, t,
                         1.f / std::sqrt(static_cast<float>(d))});
  EXPECT_TRUE(st.ok()) << st;
}

TEST_P(BackendOpsTest, DecodeAttention) {
  uint32_t seed = 500;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int len : {1, 7, 37, 733}) {
      for (auto [heads, cache_heads] :
           std::vector<std::pair<int, int>>{{1, 1}, {8, 2}, {4, 4}, {8, 4}, {8, 1}}) {
        for (int d : {8, 64, 128}) {
          for (auto [sparse, paged] : std::vector<std::pair<bool, bool>>{
                   {false, false}, {true, false}, {false, true}, {true, true}}) {
            SCOPED_TRACE(absl::StrCat("dtype=", DTypeName(t), " len=", len, " heads=", heads, "/",
                                      cache_heads, " d=", d, " sparse=", sparse, " paged=", paged));
            const int batch = 3;
            const int capacity = len + 5;
            const int64_t hs = int64_t{capacity} * d;
            std::vector<std::vector<float>> qs, ks, vs;
            std::vector<std::vector<int32_t>> idx;
            const int n_idx = sparse ? (len + 1) / 2 : 0;
            for (int b = 0; b < batch; ++b) {
              qs.push_back(Random(heads * d, seed++, -2.f, 2.f));
              ks.push_back(Random(cache_heads * hs, seed++, -2.f, 2.f));
              vs.push_back(Random(cache_heads * hs, seed++));
              std::vector<int32_t> ix;
              std::mt19937 rng(seed++);
              for (int c = 0; c < cache_heads; ++c) {
                std::vector<int32_t> perm(len);
                for (int i = 0; i < len; ++i) perm[i] = i;
                std::shuffle(perm.begin(), perm.end(), rng);
                ix.insert(ix.end(), perm.begin(), perm.begin() + n_idx);
              }
              idx.push_back(ix);
            }
            // The same rows in pages of 4 tokens, in random pages of a pool.
            std::vector<PagedRows> pk, pv;
            for (int b = 0; b < batch; ++b) {
              pk.push_back(ToPages(ks[b], cache_heads, capacity, d, 4, seed));    // one table
              pv.push_back(ToPages(vs[b], cache_heads, capacity, d, 4, seed++));  // for both
            }
            auto run = [&](KernelBackend& be, std::vector<float>* probs_out) {
              Arena a(be);
              std::vector<DecodeSequence> seqs(batch);
              std::vector<float*> outs(batch), probs(batch);
              for (int b = 0; b < batch; ++b) {
                DecodeSequence& s = seqs[b];
                s.q = a.Upload(qs[b]);
                outs[b] = a.Zeros(heads * d);
                s.out = outs[b];
                if (paged) {
                  s.k = a.Upload(Encode(pk[b].rows, t));
                  s.v = a.Upload(Encode(pv[b].rows, t));
                  s.layout = pk[b].layout;
                } else {
                  s.k = a.Upload(Encode(ks[b], t));
                  s.v = a.Upload(Encode(vs[b], t));
                  s.layout = KvLayout::Region(hs);
                }
                s.len = len;
                if (sparse) {
                  s.indices = a.Upload(idx[b]);
                  s.num_indices = n_idx;
                }
                probs[b] = a.Zeros(static_cast<size_t>(heads) * len);
                s.probs = probs[b];
              }
              RunDecodeAttention(be, seqs, heads, cache_heads, d, t);
              std::vector<float> out;
              for (int b = 0; b < batch; ++b) {
                auto o = a.Download(outs[b], heads * d);
                out.insert(out.end(), o.begin(), o.end());
                auto pr = a.Download(probs[b], static_cast<size_t>(heads) * len);
                probs_out->insert(probs_out->end(), pr.begin(), pr.end());
              }
              return out;
            };
            std::vector<float> p_got, p_want;
            const auto got = run(*backend_, &p_got);
            const auto want = run(*reference_, &p_want);
            EXPECT_TRUE(AllClose(got, want, {2e-5f, 2e-4f}));
            EXPECT_TRUE(AllClose(p_got, p_want, {1e-6f, 2e-4f}));
          }
        }
      }
    }
  }
}

// Decode attention as a decode step runs it (no probabilities asked for), over caches laid out
// as the device pool lays them out: pages of page_tokens tokens holding every head, every
// sequence's K pages in one half of one buffer and its V pages at the same places in the other.
// On cuda, bf16 caches of head_dim 64 and 128 with a query-head group FlashInfer dispatches go
// through FlashInfer's batch decode (kernels/cuda/flashinfer_decode.h), whose 16-bit outputs
// are held to f16's rounding; the rest through kvwire's kernel, to the usual bound.
TEST_P(BackendOpsTest, DecodeAttentionWithoutProbabilities) {
  uint32_t seed = 900;
  for (DType t : {DType::kBF16, DType::kF32}) {
    for (int len : {1, 37, 733, 3000}) {
      for (auto [heads, cache_heads] :
           std::vector<std::pair<int, int>>{{8, 2}, {4, 4}, {8, 1}, {6, 2}, {5, 1}}) {
        // 64 again after 128: the same lengths and group at another head dim in between, which
        // FlashInfer's plan, kept from one call to the next, must not be taken for.
        for (bool sparse : {false, true}) {
          for (int d : {64, 128, 64}) {
            SCOPED_TRACE(absl::StrCat("dtype=", DTypeName(t), " len=", len, " heads=", heads, "/",
                                      cache_heads, " d=", d, " sparse=", sparse));
            const int batch = 3, page_tokens = 16;
            const int blocks = (len + page_tokens - 1) / page_tokens;
            const int64_t page = int64_t{cache_heads} * page_tokens * d;  // elements
            const int n_pages = batch * blocks + 5;
            std::vector<int32_t> ids(n_pages);
            for (int i = 0; i < n_pages; ++i) ids[i] = i;
            std::mt19937 rng(seed++);
            std::shuffle(ids.begin(), ids.end(), rng);
            // Both halves start as noise that no row overwrites.
            std::vector<float> pool = Random(2 * n_pages * page, seed++, -3.f, 3.f);
            std::vector<std::vector<int32_t>> tables(batch), idx(batch);
            std::vector<std::vector<float>> qs;
            // The last sequence attends a third of the rows: split-KV's chunks of a batch of
            // uneven lengths (some of its chunks empty).
            auto len_of = [&](int b) { return b == batch - 1 ? (len + 2) / 3 : len; };
            auto n_idx = [&](int b) { return sparse ? (len_of(b) + 1) / 2 : 0; };
            for (int b = 0; b < batch; ++b) {
              tables[b].assign(ids.begin() + b * blocks, ids.begin() + (b + 1) * blocks);
              KvLayout layout;
              layout.pages = tables[b].data();
              layout.page_tokens = page_tokens;
              layout.heads_per_page = cache_heads;
              layout.n_heads = cache_heads;
              layout.page_stride = page;
              const std::vector<float> k =
                  Random(int64_t{cache_heads} * len * d, seed++, -2.f, 2.f);
              const std::vector<float> v = Random(int64_t{cache_heads} * len * d, seed++);
              for (int c = 0; c < cache_heads; ++c) {
                for (int i = 0; i < len; ++i) {
                  const int64_t row = layout.Row(c, i, d), from = (int64_t{c} * len + i) * d;
                  std::copy_n(k.begin() + from, d, pool.begin() + row);
                  std::copy_n(v.begin() + from, d, pool.begin() + n_pages * page + row);
                }
                std::vector<int32_t> perm(len_of(b));
                for (int i = 0; i < len_of(b); ++i) perm[i] = i;
                std::shuffle(perm.begin(), perm.end(), rng);
                idx[b].insert(idx[b].end(), perm.begin(), perm.begin() + n_idx(b));
              }
              qs.push_back(Random(heads * d, seed++, -2.f, 2.f));
            }
            auto run = [&](KernelBackend& be) {
              Arena a(be);
              const std::vector<uint8_t> bytes = Encode(pool, t);
              const uint8_t* base = a.Upload(bytes);
              const size_t half = bytes.size() / 2;
              // The queries of the batch in one array, as a decode step makes them.
              std::vector<float> all_q;
              for (const auto& q : qs) all_q.insert(all_q.end(), q.begin(), q.end());
              const float* q = a.Upload(all_q);
              float* out = a.Zeros(static_cast<size_t>(batch) * heads * d);
              std::vector<DecodeSequence> seqs(batch);
              for (int b = 0; b < batch; ++b) {
                DecodeSequence& s = seqs[b];
                s.q = q + int64_t{b} * heads * d;
                s.out = out + int64_t{b} * heads * d;
                s.k = base;
                s.v = base + half;
                s.layout.pages = tables[b].data();
                s.layout.page_tokens = page_tokens;
                s.layout.heads_per_page = cache_heads;
                s.layout.n_heads = cache_heads;
                s.layout.page_stride = page;
                s.len = len_of(b);
                if (sparse) {
                  s.indices = a.Upload(idx[b]);
                  s.num_indices = n_idx(b);
                }
              }
              RunDecodeAttention(be, seqs, heads, cache_heads, d, t);
              return a.Download(out, static_cast<size_t>(batch) * heads * d);
            };
            const int64_t before = FlashInferDecodeLaunchesHere();
            const auto got = run(*backend_);
            const bool library = FlashInferDecodeLaunchesHere() > before;
            const auto want = run(*reference_);
            const int group = heads / cache_heads;
            const bool expect_library = GetParam() == BackendKind::kCuda &&
                                        CudaDecodesThroughFlashInfer() && t == DType::kBF16 &&
                                        group != 5;
            EXPECT_EQ(library, expect_library);
            // f16 outputs: half a unit in the 11th bit of values within [-1, 1].
            EXPECT_TRUE(
                AllClose(got, want, library ? Tolerance{1e-3f, 1e-3f} : Tolerance{2e-5f, 2e-4f}));
          }
        }
      }
    }
  }
}

TEST_P(BackendOpsTest, RejectsBadShapes) {
  float x = 0, y = 0;
  MatMulParams mm;
  mm.x = &x;
  mm.w = &x;
  mm.y = &y;
  mm.m = 1;
  mm.n = 0;
  mm.k = 1;
  const absl::Status st = backend_->MatMul(mm);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("n=0"), std::string::npos) << st;

  PrefillAttentionParams pa;
  pa.q = pa.k = pa.v = &x;
  pa.out = &y;
  pa.len = 4;
  pa.n_heads = 3;
  pa.n_kv_heads = 2;
  pa.head_dim = 8;
  pa.q_stride = 24;
  pa.kv_stride = 16;
  pa.out_stride = 24;
  EXPECT_EQ(backend_->PrefillAttention(pa).code(), absl::StatusCode::kInvalidArgument);

  DecodeAttentionParams da;
  da.n_heads = 4;
  da.n_cache_heads = 3;
  da.head_dim = 8;
  EXPECT_EQ(backend_->DecodeAttention(da).code(), absl::StatusCode::kInvalidArgument);
}

// A step recorded as a graph (BeginGraph ... EndGraph) runs only at EndGraph, with each host
// array as it was at its call, and gives what the same ops give called one by one; recording
// again under the same key (new inputs, the graph updated in place on cuda) gives the new
// results. While recording, every wait and read is refused (another thread's are not); an
// aborted recording runs nothing; a Free while recording voids the graph. The host backends run ops
// as called: Unimplemented.
TEST_P(BackendOpsTest, GraphsRunTheRecordedOpsAtEnd) {
  KernelBackend& b = *backend_;
  if (!b.SupportsGraphs()) {
    const absl::Status st = b.BeginGraph(1);
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
    EXPECT_EQ(b.EndGraph().code(), absl::StatusCode::kUnimplemented);
    return;
  }
  const int rows = 3, dim = 64, out = 40, vocab = 11;
  Arena a(b);
  const std::vector<float> table = Random(int64_t{vocab} * dim, 1200);
  const std::vector<float> weight = Random(dim, 1201, 0.5f, 1.5f);
  const std::vector<float> w = Random(int64_t{out} * dim, 1202);
  float* x = a.Zeros(rows * dim);
  float* embedded = a.Zeros(rows * dim);
  float* h = a.Zeros(rows * dim);
  float* y = a.Zeros(rows * out);
  const float* table_d = a.Upload(table);
  const float* weight_d = a.Upload(weight);
  const void* w_d = a.Upload(Encode(w, DType::kBF16));
  // The ops of a small step: the inputs up, an embedding lookup, the residual norm, a product.
  auto step = [&](const std::vector<float>& x_host, std::vector<int32_t> ids) -> absl::Status {
    RETURN_IF_ERROR(b.CopyToDevice(x, x_host.data(), x_host.size() * sizeof(float)));
    EmbedRowsParams e{table_d, DType::kF32, vocab, dim, ids.data(), rows, embedded};
    RETURN_IF_ERROR(b.EmbedRows(e));
    std::fill(ids.begin(), ids.end(), 0);  // the op copied them at its call
    RmsNormParams n{embedded, weight_d, h, rows, dim};
    n.residual = x;
    RETURN_IF_ERROR(b.RmsNorm(n));
    MatMulParams m;
    m.x = h;
    m.w = w_d;
    m.w_dtype = DType::kBF16;
    m.y = y;
    m.m = rows;
    m.n = out;
    m.k = dim;
    return b.MatMul(m);
  };
  auto eager = [&](const std::vector<float>& x_host, const std::vector<int32_t>& ids) {
    EXPECT_TRUE(step(x_host, ids).ok());
    return std::make_pair(a.Download(y, rows * out), a.Download(x, rows * dim));
  };
  const KernelBackend::GraphCounts start = b.graph_counts();
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const std::vector<float> x_host = Random(rows * dim, 1210 + round);
    const std::vector<int32_t> ids = {round + 1, 10 - round, 4};
    const auto want = eager(x_host, ids);
    ASSERT_TRUE(
        b.CopyToDevice(y, std::vector<float>(rows * out, 0.f).data(), rows * out * sizeof(float))
            .ok());
    ASSERT_TRUE(b.Synchronize().ok());
    ASSERT_TRUE(b.BeginGraph(7).ok());
    ASSERT_TRUE(step(x_host, ids).ok());
    std::vector<float> host(rows * out);
    uint32_t sum = 0;
    const ByteSpan span{reinterpret_cast<const uint8_t*>(y), 4};
    for (const absl::Status& st : {b.Synchronize(), b.CopyToHost(host.data(), y, sizeof(float)),
                                   b.CopyToHostAsync(host.data(), y, sizeof(float)).status(),
                                   b.ChecksumSpans({&span, 1, &sum}), b.BeginGraph(8)}) {
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    }
    // Another thread's work meanwhile, its buffers freed (a device-wide wait on CUDA, which
    // must not void this thread's recording), leaves the recording as it was.
    std::thread other([&b] {
      auto buffer = b.Allocate(1 << 20);
      ASSERT_TRUE(buffer.ok());
      const std::vector<uint8_t> bytes(1 << 20, 3);
      EXPECT_TRUE(b.CopyToDevice(*buffer, bytes.data(), bytes.size()).ok());
      EXPECT_TRUE(b.Synchronize().ok());
      b.Free(*buffer);
    });
    other.join();
    ASSERT_TRUE(b.EndGraph().ok());
    EXPECT_EQ(a.Download(y, rows * out), want.first);
    EXPECT_EQ(a.Download(x, rows * dim), want.second);  // the residual stream, updated in place
  }
  const KernelBackend::GraphCounts counts = b.graph_counts();
  EXPECT_EQ(counts.launched - start.launched, 2);
  EXPECT_EQ(counts.made - start.made, 1);
  EXPECT_EQ(counts.updated - start.updated, 1);

  // Aborted: nothing recorded runs, and the backend goes on op by op.
  const std::vector<float> before = a.Download(y, rows * out);
  ASSERT_TRUE(b.BeginGraph(7).ok());
  ASSERT_TRUE(step(Random(rows * dim, 1220), {0, 1, 2}).ok());
  b.AbortGraph();
  EXPECT_EQ(a.Download(y, rows * out), before);
  EXPECT_EQ(b.EndGraph().code(), absl::StatusCode::kFailedPrecondition);  // none recording
  // A Free while recording (the graph's ops might use the buffer) voids the graph.
  auto spare = b.Allocate(64);
  ASSERT_TRUE(spare.ok());
  ASSERT_TRUE(b.BeginGraph(7).ok());
  ASSERT_TRUE(step(Random(rows * dim, 1221), {0, 1, 2}).ok());
  b.Free(*spare);
  EXPECT_FALSE(b.EndGraph().ok());
  EXPECT_EQ(a.Download(y, rows * out), before);
  const std::vector<float> x_host = Random(rows * dim, 1222);
  const auto again = eager(x_host, {3, 3, 3});
  EXPECT_NE(again.first, before);
  EXPECT_TRUE(b.Synchronize().ok());
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendOpsTest,
                         ::testing::Values(BackendKind::kCpu, BackendKind::kCuda,
                                           BackendKind::kGuarded),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return std::string(BackendName(info.param));
                         });

// The host backends' buffers (weights, activations) from 2 MiB up are huge-page candidates:
// decode at batch 1 streams every weight once a token, and on 4 KiB pages each page boundary
// costs a TLB walk and stops the hardware prefetcher (common/base/host_alloc.h).
TEST(HostBackends, LargeBuffersAskForHugePagesSmallOnesDoNot) {
  KVWIRE_REQUIRE_VMFLAGS();
  for (BackendKind kind : {BackendKind::kCpu, BackendKind::kReference}) {
    auto b = MakeBackend(kind, 1);
    ASSERT_TRUE(b.ok()) << b.status();
    const size_t big = size_t{5} << 20;
    auto large = (*b)->Allocate(big);
    ASSERT_TRUE(large.ok()) << large.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*large) % (size_t{2} << 20), 0u) << BackendName(kind);
    EXPECT_NE(testing::VmFlagsOf(*large).find(" hg"), std::string::npos) << BackendName(kind);
    std::memset(*large, 1, big);
    auto small = (*b)->Allocate(1000);
    ASSERT_TRUE(small.ok()) << small.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*small) % 64, 0u);
    EXPECT_EQ(testing::VmFlagsOf(*small).find(" hg"), std::string::npos) << BackendName(kind);
    (*b)->Free(*large);
    (*b)->Free(*small);
  }
}

// The guarded backend's memory is the host's only inside its ops: a direct read or write of
// it between ops dies (that is what makes it a test of the engine's device path), while
// copies and ops see it.
TEST(GuardedBackend, HostAccessBetweenOpsDies) {
  auto b = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE((*b)->host_addressable());
  auto mem = (*b)->Allocate(64 * sizeof(float));
  ASSERT_TRUE(mem.ok()) << mem.status();
  auto* p = static_cast<float*>(*mem);
  const std::vector<float> ones(64, 1.f);
  ASSERT_TRUE((*b)->CopyToDevice(p, ones.data(), 64 * sizeof(float)).ok());
  RmsNormParams norm{p, p, p + 16, 1, 16, 0.f};  // residual p[32, 48) += p[0, 16): 2s
  norm.residual = p + 32;
  ASSERT_TRUE((*b)->RmsNorm(norm).ok());
  std::vector<float> back(64);
  ASSERT_TRUE((*b)->CopyToHost(back.data(), p, 64 * sizeof(float)).ok());
  EXPECT_EQ(back[40], 2.f);
  EXPECT_DEATH(
      {
        volatile float x = p[3];
        (void)x;
      },
      "");
  EXPECT_DEATH(p[3] = 5.f, "");
  (*b)->Free(p);
}

// Its ops take only its own memory, as GPU kernels take only device memory: a host array
// passed where the op reads or writes is refused, naming the parameter.
TEST(GuardedBackend, OpsRefuseHostPointers) {
  auto b = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  Arena a(**b);
  std::vector<float> host_x(8, 1.f);
  float* y = a.Zeros(8);
  const float* w = a.Zeros(8);
  absl::Status st = (*b)->RmsNorm({host_x.data(), w, y, 1, 8});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("RmsNorm's x"), std::string::npos) << st;
  st = (*b)->RmsNorm({y, w, host_x.data(), 1, 8});
  EXPECT_NE(st.message().find("RmsNorm's y"), std::string::npos) << st;
  RmsNormParams norm{y, w, y, 1, 8};
  norm.residual = host_x.data();
  st = (*b)->RmsNorm(norm);
  EXPECT_NE(st.message().find("RmsNorm's residual"), std::string::npos) << st;
  DecodeSequence seq;
  seq.q = a.Zeros(8);
  seq.out = a.Zeros(8);
  seq.k = seq.v = a.Zeros(8);
  seq.layout = KvLayout::Region(8);
  seq.len = 1;
  std::vector<int32_t> host_indices = {0};
  seq.indices = host_indices.data();
  seq.num_indices = 1;
  st = (*b)->DecodeAttention({&seq, 1, 1, 1, 8, DType::kF32, 1.f});
  EXPECT_NE(st.message().find("DecodeAttention's indices"), std::string::npos) << st;
  seq.indices = a.Upload(host_indices);
  EXPECT_TRUE((*b)->DecodeAttention({&seq, 1, 1, 1, 8, DType::kF32, 1.f}).ok());
}

// Every range an op reads or writes must lie within one buffer: a length past a buffer's end
// is refused before anything runs, naming the parameter.
TEST(GuardedBackend, OpsRefuseRangesPastABuffer) {
  auto b = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  Arena a(**b);
  float* x = a.Zeros(32);
  float* y = a.Zeros(32);
  const float* w = a.Zeros(33);
  RmsNormParams norm{x, w, x, 1, 32};
  norm.residual = y;
  EXPECT_TRUE((*b)->RmsNorm(norm).ok());
  norm.dim = 33;
  absl::Status st = (*b)->RmsNorm(norm);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("RmsNorm's x (132 bytes) is not within one buffer"),
            std::string::npos)
      << st;
  norm.dim = 32;
  norm.residual = y + 1;
  st = (*b)->RmsNorm(norm);
  EXPECT_NE(st.message().find("RmsNorm's residual"), std::string::npos) << st;
  std::vector<float> out(40);
  EXPECT_EQ((*b)->CopyToHost(out.data(), x, 40 * sizeof(float)).code(),
            absl::StatusCode::kInvalidArgument);
}

// Work is queued, as on a stream: a copy takes its source when it is called (the caller may
// change it right after), and nothing lands in backend memory before a synchronisation.
TEST(GuardedBackend, CopiesAndOpsRunAtTheNextSynchronisation) {
  auto b = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  Arena a(**b);
  float* x = a.Zeros(4);
  std::vector<float> src = {1, 2, 3, 4};
  ASSERT_TRUE((*b)->CopyToDevice(x, src.data(), 4 * sizeof(float)).ok());
  src.assign(4, 9.f);  // after the call: the copy already has its data
  ASSERT_TRUE((*b)->SwiGlu({a.Zeros(8), a.Zeros(4), 1, 4}).ok());  // queued with the copy
  std::vector<float> back(4);
  auto ticket = (*b)->CopyToHostAsync(back.data(), x, 4 * sizeof(float));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(back, std::vector<float>(4, 0.f));  // not yet
  ASSERT_TRUE((*b)->WaitCopy(*ticket).ok());
  EXPECT_EQ(back, (std::vector<float>{1, 2, 3, 4}));
}

// Each thread's work is its own queue, as each thread's stream on CUDA: another thread's
// synchronisation does not run it (what it reads is stale until the first thread waits), and a
// free, as cudaFree waits for the whole device, runs everyone's.
TEST(GuardedBackend, EachThreadsWorkRunsAtItsOwnSynchronisation) {
  auto b = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  Arena a(**b);
  float* x = a.Zeros(4);
  float* y = a.Zeros(4);
  ASSERT_TRUE((*b)->Synchronize().ok());
  const std::vector<float> ones(4, 1.f), twos(4, 2.f), zeros(4, 0.f);
  auto read_elsewhere = [&](const float* p) {
    std::vector<float> back(4, -1.f);
    std::thread([&] {
      EXPECT_TRUE((*b)->CopyToHost(back.data(), p, 4 * sizeof(float)).ok());
    }).join();
    return back;
  };
  ASSERT_TRUE((*b)->CopyToDevice(x, ones.data(), 4 * sizeof(float)).ok());
  EXPECT_EQ(read_elsewhere(x), zeros);  // queued on this thread, not run by the other's wait
  ASSERT_TRUE((*b)->Synchronize().ok());
  EXPECT_EQ(read_elsewhere(x), ones);
  ASSERT_TRUE((*b)->CopyToDevice(y, twos.data(), 4 * sizeof(float)).ok());
  auto z = (*b)->Allocate(64);
  ASSERT_TRUE(z.ok()) << z.status();
  std::thread([&] { (*b)->Free(*z); }).join();  // a device-wide wait: this thread's copy ran
  EXPECT_EQ(read_elsewhere(y), twos);
}

// A device fault that leaves it unusable (MarkFaulted; CUDA's sticky errors on a GPU): the
// first fault stays, queued work is dropped, and every synchronisation and copy back fails with
// it from then on.
TEST(GuardedBackend, AFaultedDeviceRunsNothingMore) {
  auto b = MakeBackend(BackendKind::kGuarded, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE((*b)->fault().ok());
  Arena a(**b);
  float* x = a.Zeros(4);
  float* y = a.Zeros(4);
  std::vector<float> ones(4, 1.f);
  ASSERT_TRUE((*b)->CopyToDevice(x, ones.data(), 4 * sizeof(float)).ok());
  ASSERT_TRUE((*b)->RmsNorm({x, x, y, 1, 4}).ok());  // queued
  (*b)->MarkFaulted(absl::InternalError("an illegal memory access was encountered"));
  (*b)->MarkFaulted(absl::InternalError("a later error"));  // the first one stays
  EXPECT_NE(std::string((*b)->fault().message()).find("illegal memory access"), std::string::npos);
  const absl::Status st = (*b)->Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(std::string(st.message()).find("illegal memory access"), std::string::npos) << st;
  std::vector<float> back(4, -1.f);
  EXPECT_FALSE((*b)->CopyToHost(back.data(), y, 4 * sizeof(float)).ok());
  EXPECT_EQ(back, std::vector<float>(4, -1.f));  // nothing ran, nothing came back
}

// A capacity makes the device's out-of-memory paths testable: allocations past it are
// RESOURCE_EXHAUSTED, and memory freed is available again. Host backends refuse a limit.
TEST(GuardedBackend, CapacityLimitsAllocations) {
  auto b = MakeBackend(BackendKind::kGuarded, 1, 1 << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  auto first = (*b)->Allocate(600 << 10);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = (*b)->Allocate(600 << 10);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find("capacity of 1048576 bytes"), std::string::npos)
      << second.status();
  (*b)->Free(*first);
  auto third = (*b)->Allocate(600 << 10);
  ASSERT_TRUE(third.ok()) << third.status();
  (*b)->Free(*third);
  for (BackendKind host : {BackendKind::kCpu, BackendKind::kReference}) {
    auto refused = MakeBackend(host, 1, 1 << 20);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(BackendFactory, CudaWithoutGpuSaysWhy) {
  if (CudaAvailable()) GTEST_SKIP() << "a GPU is present";
  auto b = MakeBackend(BackendKind::kCuda);
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(b.status().code() == absl::StatusCode::kUnimplemented ||
              b.status().code() == absl::StatusCode::kUnavailable)
      << b.status();
  EXPECT_FALSE(b.status().message().empty());
}

// An environment variable set for a test and put back as it was however the test ends (later
// tests make backends too).
class ScopedEnv {
 public:
  explicit ScopedEnv(const char* name) : name_(name) {
    if (const char* before = std::getenv(name)) before_ = before;
  }
  ~ScopedEnv() {
    if (before_) {
      setenv(name_, before_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  void Set(const char* value) const { setenv(name_, value, 1); }

 private:
  const char* name_;
  std::optional<std::string> before_;
};

// A CUDA backend made with `name` set to each of `bad` is refused as an invalid argument that
// names the variable; with each of `good`, made.
void ExpectCudaBackendEnv(const char* name, const std::vector<const char*>& bad,
                          const std::vector<const char*>& good) {
  const ScopedEnv env(name);
  for (const char* value : bad) {
    SCOPED_TRACE(value);
    env.Set(value);
    auto b = MakeBackend(BackendKind::kCuda);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(b.status().message().find(name), std::string::npos) << b.status();
  }
  for (const char* value : good) {
    env.Set(value);
    auto b = MakeBackend(BackendKind::kCuda);
    EXPECT_TRUE(b.ok()) << value << ": " << b.status();
  }
}

// KVWIRE_CUDA_BF16_GEMV_ROWS (the most rows of x whose bf16 products go to kvwire's GEMV rather
// than cuBLAS) is a number of rows from 0 (the switch's own choice) to 16, else the backend is
// refused, saying so.
TEST(BackendFactory, CudaRefusesABf16GemvRowCountOutOfRange) {
  if (!CudaAvailable()) GTEST_SKIP() << "no GPU: the CUDA backend is not made";
  ExpectCudaBackendEnv("KVWIRE_CUDA_BF16_GEMV_ROWS", {"17", "-1", "8 rows", "x"}, {"0", "16"});
}

// KVWIRE_CUDA_TOPK (TopK through FlashInfer's top-k where it serves, or CUB's sort) is one of
// the two, or unset; anything else is refused, saying so.
TEST(BackendFactory, CudaRefusesAnUnknownTopKKernel) {
  if (!CudaAvailable()) GTEST_SKIP() << "no GPU: the CUDA backend is not made";
  std::vector<const char*> good = {"cub", ""};
  if (FlashInferBuilt()) good.push_back("flashinfer");
  ExpectCudaBackendEnv("KVWIRE_CUDA_TOPK", {"CUB", "radix", "flashinfer "}, good);
}

TEST(BackendFactory, ParsesNames) {
  EXPECT_EQ(*ParseBackendKind("cpu"), BackendKind::kCpu);
  EXPECT_EQ(*ParseBackendKind("reference"), BackendKind::kReference);
  EXPECT_EQ(ParseBackendKind("tpu").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvwire::kernels
