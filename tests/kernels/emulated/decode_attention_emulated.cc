// kernels/cuda/decode_attention.cuh (the plain decode kernels: a warp per query head and chunk
// of tokens, the chunks merged by their log-sum-exp) run where no GPU is, as
// coded_decode_emulated.cc runs the coded one: compiled as host code over this folder's
// stand-ins, every block on emulated threads under several scheduling orders, with the
// launcher's split (SplitFor) and forced ones, against the reference. Caches in each dtype and
// coded, in regions and pages, dense and sparse (indices in any order), with probabilities (one
// pass) and without (split).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/kv_format.h"
#include "decode_batch.h"
#include "emulated_block.h"
#include "kernels/backend.h"
#include "kernels/cuda/decode_attention.cuh"  // over the stand-in cuda_util.cuh

namespace kvwire {
namespace {

namespace pd = kernels::cuda::plain_decode;
using emulated::BatchCase;
using kernels::DecodeAttentionParams;

// The kernels over `p` as LaunchDecodeAttention launches them, with the launcher's split or
// (chunk_tokens > 0, no probabilities asked) chunks of that many tokens.
absl::Status Emulate(const DecodeAttentionParams& p, int chunk_tokens, emulated::Order order) {
  pd::Split split = pd::SplitFor(p);
  if (chunk_tokens > 0 && split.chunks * split.chunk_tokens > 0) {
    bool probs = false;
    for (int b = 0; b < p.batch; ++b) probs |= p.seqs[b].probs != nullptr;
    if (!probs) {
      const int most = split.chunks * split.chunk_tokens;  // at least the most attended tokens
      split.chunk_tokens = chunk_tokens;
      split.chunks = (most + chunk_tokens - 1) / chunk_tokens;
    }
  }
  const int64_t items = int64_t{p.batch} * p.n_heads;
  emulated::Partials part(p, split.chunks);
  const emulated::Dim3 grid{
      static_cast<unsigned>((items + pd::kWarpsPerBlock - 1) / pd::kWarpsPerBlock),
      static_cast<unsigned>(split.chunks), 1};
  const absl::Status ran = kernels::cuda::DispatchDType(p.kv_dtype, [&]<typename T>() {
    return kernels::cuda::DispatchHeadDim(p.head_dim, [&]<int DPL>() {
      return emulated::RunGrid(grid, 32 * pd::kWarpsPerBlock, order,
                               [&] {
                                 pd::DecodeAttentionKernel<T, DPL>(
                                     p.seqs, p.batch, p.n_heads, p.n_cache_heads, p.head_dim,
                                     p.scale, split.chunks, split.chunk_tokens, part.m, part.l,
                                     part.acc);
                               })
                 ? absl::OkStatus()
                 : absl::InternalError("the block's threads deadlocked");
    });
  });
  if (!ran.ok() || split.chunks <= 1) return ran;
  return emulated::MergeOnBlocks(p, split.chunks, part.m, part.l, part.acc, order);
}

TEST(DecodeAttentionEmulated, EqualsTheReference) {
  constexpr KvFormat kAuto = KvFormat::kAuto, kF8 = KvFormat::kFP8, kI8 = KvFormat::kInt8,
                     kI4 = KvFormat::kInt4;
  // Lengths about the split's 256 tokens, head dims that fill a lane's dims or leave some
  // empty (80, 200), groups 1 to 8; the coded caches (which the plain kernel reads for sparse
  // selections and probabilities) with appended tokens in their residuals.
  const BatchCase cases[] = {
      {64,
       4,
       DType::kBF16,
       4 << 10,
       {{kAuto, 700, 3}, {kAuto, 1, 0}, {kAuto, 255, 2}, {kAuto, 300, 0, 97}}},
      {128, 2, DType::kF32, 0, {{kAuto, 513, 0}, {kAuto, 40, 1, 17}, {kAuto, 90, 0, 0, true}}},
      {80, 1, DType::kF16, 8 << 10, {{kAuto, 257, 0}, {kAuto, 600, 5, 600}, {kAuto, 3, 0}}},
      {32, 8, DType::kF32, 0, {{kAuto, 100, 0, 0, true}, {kAuto, 50, 0, 20, true}}},
      {200, 2, DType::kBF16, 0, {{kAuto, 333, 1}, {kAuto, 17, 0, 5}}},
      {128,
       4,
       DType::kBF16,
       64 << 10,
       {{kI4, 300, 150, 200}, {kF8, 290, 0}, {kI8, 40, 3}, {kAuto, 260, 0, 260}}},
      {64, 2, DType::kF32, 4 << 10, {{kF8, 17, 128, 100}, {kI8, 145, 1}, {kI4, 272, 5, 30}}},
      {128, 1, DType::kBF16, 8 << 10, {{kI4, 272, 5, 0, true}, {kI8, 40, 3, 0, true}}},
      {256, 1, DType::kF16, 0, {{kI8, 129, 127, 64}, {kI4, 16, 0}, {kF8, 1, 261, 0, true}}},
  };
  int run = 0;
  for (const BatchCase& cs : cases) {
    SCOPED_TRACE(absl::StrCat("d ", cs.d, " group ", cs.group, " ", DTypeName(cs.dtype),
                              cs.page_bytes ? " paged" : " regions"));
    emulated::DecodeBatch batch;
    ASSERT_NO_FATAL_FAILURE(batch.Build(cs));
    // The launcher's split; chunks of 1, 7 and 100 tokens (some chunks past a head's tokens);
    // each under another scheduling order.
    for (int chunk_tokens : {0, 1, 7, 100}) {
      const emulated::Order order = emulated::kOrders[run++ % std::size(emulated::kOrders)];
      SCOPED_TRACE(
          absl::StrCat("chunk tokens ", chunk_tokens, ", order ", static_cast<int>(order)));
      std::vector<std::vector<float>> out, probs;
      const absl::Status ran = Emulate(batch.Fresh(&out, &probs), chunk_tokens, order);
      ASSERT_TRUE(ran.ok()) << ran;
      batch.Expect(out, probs);
    }
  }
}

// The launcher's split at the sizes no emulated batch reaches: chunks of more than half of
// kSplitTokens covering the longest head's tokens, no more warps in flight than kSplitWarps allows
// (the scratch's bound), and one pass where probabilities are asked for.
TEST(DecodeAttentionEmulated, TheSplitCoversEveryTokenWithinItsBound) {
  struct Shape {
    int batch, heads, len;
    bool probs;
  };
  for (const Shape& sh :
       {Shape{1, 32, 32768, false}, Shape{64, 32, 32768, false}, Shape{8, 32, 300, false},
        Shape{8, 32, 256, false}, Shape{256, 64, 131072, false}, Shape{4, 8, 5000, true}}) {
    SCOPED_TRACE(absl::StrCat("batch ", sh.batch, " heads ", sh.heads, " len ", sh.len));
    std::vector<kernels::DecodeSequence> seqs(sh.batch);
    std::vector<float> probs(1);
    for (int b = 0; b < sh.batch; ++b) {
      seqs[b].len = b == 0 ? sh.len : sh.len / 3 + 1;
      if (sh.probs && b == 1) seqs[b].probs = probs.data();
    }
    DecodeAttentionParams p;
    p.batch = sh.batch;
    p.n_heads = sh.heads;
    p.seqs = seqs.data();
    const pd::Split split = pd::SplitFor(p);
    const int64_t items = int64_t{sh.batch} * sh.heads;
    EXPECT_GE(split.chunks, 1);
    EXPECT_GE(int64_t{split.chunks} * split.chunk_tokens, sh.len);
    EXPECT_LT(int64_t{split.chunks - 1} * split.chunk_tokens, sh.len);  // no chunk wholly empty
    if (sh.probs) {
      EXPECT_EQ(split.chunks, 1);
    } else {
      EXPECT_LE(split.chunks, std::max<int64_t>(1, pd::kSplitWarps / items));
      if (split.chunks > 1) {
        EXPECT_GT(split.chunk_tokens, pd::kSplitTokens / 2);
      }
    }
  }
}

}  // namespace
}  // namespace kvwire
