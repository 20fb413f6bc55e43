// kernels/cuda/coded_decode.cuh run where no GPU is: compiled as host code over stand-ins for
// CUDA's intrinsics (this folder's kernels/cuda/cuda_util.cuh) and run block by block on
// emulated threads (emulated_block.h), under several scheduling orders, with the launcher's own
// split (SplitFor) and forced ones, the partials merged by decode_attention.cuh's MergeChunks,
// emulated too. Against the reference backend over the same codes, as CodedDecodeBatch checks the
// kernel on a GPU. This catches the kernel's indexing, its units and chunks, its online softmax
// and a barrier missing between a shared write and its reads; not what only a GPU shows (speed,
// the memory model, launch limits).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/kv_format.h"
#include "decode_batch.h"
#include "emulated_block.h"
#include "kernels/backend.h"
#include "kernels/cuda/coded_decode.cuh"  // over the stand-in cuda_util.cuh

namespace kvwire {
namespace {

namespace cd = kernels::cuda::coded_decode;
using emulated::BatchCase;
using kernels::DecodeAttentionParams;

// The kernel over `p` as LaunchCodedDecode cuts it (or in chunks of `per` units), every block
// emulated, then the merge.
absl::Status Emulate(const DecodeAttentionParams& p, int per, emulated::Order order) {
  cd::Split split = cd::SplitFor(p);
  if (per > 0) {
    const int units = split.per * split.chunks;  // at least the most units of a head
    split.per = per;
    split.chunks = (units + per - 1) / per;
  }
  emulated::Partials part(p, split.chunks);
  const emulated::Dim3 grid{static_cast<unsigned>(p.batch * p.n_cache_heads),
                            static_cast<unsigned>(split.chunks), 1};
  const int group = p.n_heads / p.n_cache_heads;
  auto run = [&]<typename T, int G>() {
    return emulated::RunGrid(grid, cd::kThreads, order, [&] {
      cd::CodedDecodeKernel<T, G>(p.seqs, p.n_cache_heads, p.head_dim, p.scale, split.chunks,
                                  split.per, part.m, part.l, part.acc);
    });
  };
  const absl::Status ran = kernels::cuda::DispatchDType(p.kv_dtype, [&]<typename T>() {
    const bool ok = group == 1   ? run.template operator()<T, 1>()
                    : group == 2 ? run.template operator()<T, 2>()
                    : group == 4 ? run.template operator()<T, 4>()
                                 : run.template operator()<T, 8>();
    return ok ? absl::OkStatus() : absl::InternalError("the block's threads deadlocked");
  });
  if (!ran.ok() || split.chunks <= 1) return ran;
  return emulated::MergeOnBlocks(p, split.chunks, part.m, part.l, part.acc, order);
}

TEST(CodedDecodeEmulated, EqualsTheReference) {
  constexpr KvFormat kF8 = KvFormat::kFP8, kI8 = KvFormat::kInt8, kI4 = KvFormat::kInt4;
  // Kept lengths around the groups' edges (16 recent tokens, groups of 128), appended ones that
  // fill a group or leave 1 to 127 in the residual; every format in each batch.
  const BatchCase cases[] = {
      {128,
       4,
       DType::kBF16,
       64 << 10,
       {{kI4, 1500, 150}, {kF8, 290, 0}, {kI8, 40, 3}, {kI4, 7, 0}}},
      {64, 8, DType::kF32, 4 << 10, {{kF8, 17, 128}, {kI8, 145, 1}, {kI4, 272, 255}}},
      {256, 1, DType::kF16, 0, {{kI8, 129, 127}, {kI4, 16, 0}, {kF8, 1, 261}}},
      {128, 2, DType::kF32, 8 << 10, {{kI4, 144, 3}, {kF8, 600, 0}, {kI8, 128, 128}}},
      {64, 4, DType::kBF16, 0, {{kF8, 300, 40}, {kI4, 33, 0}, {kI8, 1, 1}}},
  };
  int run = 0;
  for (const BatchCase& cs : cases) {
    SCOPED_TRACE(absl::StrCat("d ", cs.d, " group ", cs.group, " ", DTypeName(cs.dtype),
                              cs.page_bytes ? " paged" : " regions"));
    emulated::DecodeBatch batch;
    ASSERT_NO_FATAL_FAILURE(batch.Build(cs));
    // The launcher's split, a unit per block (some blocks past a head's units), three units a
    // block, and all in one; each under another scheduling order.
    for (int per : {0, 1, 3, 1 << 20}) {
      const emulated::Order order = emulated::kOrders[run++ % std::size(emulated::kOrders)];
      SCOPED_TRACE(absl::StrCat("units per block ", per, ", order ", static_cast<int>(order)));
      std::vector<std::vector<float>> out, probs;
      const DecodeAttentionParams& p = batch.Fresh(&out, &probs);
      const absl::Status ran = Emulate(p, per, order);
      ASSERT_TRUE(ran.ok()) << ran;
      batch.Expect(out, probs);
    }
  }
}

}  // namespace
}  // namespace kvwire
