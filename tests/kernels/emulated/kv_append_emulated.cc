// kernels/cuda/kv_append.cuh (AppendKv: each sequence's new rows stored at its token t, a coded
// cache's residual coded into its rows when a group fills) run where no GPU is, on emulated
// blocks under several scheduling orders, as the other emulated kernels run: a cache appended
// to by the emulated kernel holds, byte for byte, what the same cache appended to by the
// reference holds (code rows, groups' parameters, fp8 scales, residuals; rows in the dtype).
// A batch mixes formats, query heads keep their KV head's rows (GQA kept per query head), caches
// in regions and in pages.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/kv_format.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "emulated_block.h"
#include "kernels/backend.h"
#include "kernels/cuda/kv_append.cuh"  // over the stand-in cuda_util.cuh
#include "tests/common/model/random_cache.h"

namespace kvwire {
namespace {

namespace ak = kernels::cuda::append_kv;
using kernels::AppendKvParams;
using kernels::KvAppend;

absl::Status Emulate(const AppendKvParams& p, emulated::Order order) {
  const emulated::Dim3 grid{static_cast<unsigned>(p.batch * p.n_cache_heads * 2), 1, 1};
  return kernels::cuda::DispatchDType(p.kv_dtype, [&]<typename T>() {
    return emulated::RunGrid(grid, ak::ThreadsFor(p.head_dim), order,
                             [&] {
                               ak::AppendKvKernel<T>(p.seqs, p.n_kv_heads, p.n_cache_heads,
                                                     p.head_dim, p.kv_dtype);
                             })
               ? absl::OkStatus()
               : absl::InternalError("the block's threads deadlocked");
  });
}

struct Case {
  int d, kv_heads, cache_heads;
  DType dtype;
  size_t page_bytes;  // 0: caches in host regions
  std::vector<KvFormat> formats;
  int kept;
};

TEST(KvAppendEmulated, StoresAndCodesAsTheReference) {
  constexpr KvFormat kAuto = KvFormat::kAuto, kF8 = KvFormat::kFP8, kI8 = KvFormat::kInt8,
                     kI4 = KvFormat::kInt4;
  // Appended tokens that fill two groups and leave a residual (a group is kKeyGroupTokens);
  // head dims under a warp (20), of two warps' threads and of 256 threads a block (d 300).
  constexpr int kAppended = 2 * kKeyGroupTokens + 9;
  const Case cases[] = {
      {64, 2, 2, DType::kBF16, 4 << 10, {kI4, kF8, kI8, kAuto}, 40},
      {128, 1, 4, DType::kF32, 0, {kF8, kI4, kAuto}, 130},
      {64, 2, 4, DType::kF16, 8 << 10, {kI8, kAuto, kI4}, 70},
      {20, 2, 2, DType::kF16, 0, {kI8, kI4, kF8, kAuto}, 7},
      {256, 2, 2, DType::kBF16, 8 << 10, {kI4, kF8}, 16},
      {300, 1, 1, DType::kF32, 0, {kAuto}, 3},
  };
  auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
  ASSERT_TRUE(reference.ok());
  int run = 0;
  for (const Case& cs : cases) {
    SCOPED_TRACE(absl::StrCat("d ", cs.d, ", ", cs.kv_heads, " KV heads kept as ", cs.cache_heads,
                              ", ", DTypeName(cs.dtype), cs.page_bytes ? " paged" : " regions"));
    std::unique_ptr<KvPool> pools[2];
    if (cs.page_bytes > 0) {
      for (auto& pool : pools) {
        auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 1);
        ASSERT_TRUE(cpu.ok());
        auto made = KvPool::OnBackend(std::move(*cpu), size_t{64} << 20, cs.page_bytes);
        ASSERT_TRUE(made.ok()) << made.status();
        pool = std::move(*made);
      }
    }
    // [0]: appended to by the reference, [1]: by the emulated kernel; the same rows.
    std::vector<std::unique_ptr<KvCache>> caches[2];
    for (int side = 0; side < 2; ++side) {
      for (size_t b = 0; b < cs.formats.size(); ++b) {
        caches[side].push_back(RandomCache(cs.formats[b], cs.dtype, cs.d, cs.cache_heads, cs.kept,
                                           kAppended, static_cast<uint32_t>(b + 1),
                                           pools[side].get(), /*size_every=*/97));
        ASSERT_NE(caches[side].back(), nullptr);
      }
    }
    std::mt19937 rng(static_cast<uint32_t>(cs.d));
    for (int step = 0; step < kAppended; ++step) {
      const int n = static_cast<int>(cs.formats.size());
      std::vector<std::vector<float>> k(n), v(n);
      for (int b = 0; b < n; ++b) {
        k[b] = RandomRows(cs.kv_heads, cs.d, rng, 1.f, /*size_every=*/1);
        v[b] = RandomRows(cs.kv_heads, cs.d, rng, 0.5f, /*size_every=*/1);
      }
      for (int side = 0; side < 2; ++side) {
        std::vector<KvAppend> seqs;
        for (int b = 0; b < n; ++b) {
          LayerCache& lc = caches[side][b]->layer(0);
          seqs.push_back({k[b].data(), v[b].data(), lc.k, lc.v, lc.layout, lc.coding, lc.len});
        }
        const AppendKvParams p{seqs.data(), n, cs.kv_heads, cs.cache_heads, cs.d, cs.dtype};
        const emulated::Order order = emulated::kOrders[run % std::size(emulated::kOrders)];
        const absl::Status st = side == 0 ? (*reference)->AppendKv(p) : Emulate(p, order);
        ASSERT_TRUE(st.ok()) << st;
        for (int b = 0; b < n; ++b) ++caches[side][b]->layer(0).len;
      }
      ++run;
    }
    for (size_t b = 0; b < cs.formats.size(); ++b) {
      SCOPED_TRACE(absl::StrCat("sequence ", b, " (", KvFormatName(cs.formats[b]), ")"));
      EXPECT_TRUE(SameBytes(LayerBytes(**reference, caches[1][b]->layer(0)),
                            LayerBytes(**reference, caches[0][b]->layer(0))));
    }
  }
}

}  // namespace
}  // namespace kvwire
