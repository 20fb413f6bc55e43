// A decode-attention batch over random caches (in the dtype or coded, in host regions or a
// pool's pages, tokens appended through the reference's AppendKv, dense or sparse, with or
// without probabilities) and the reference's answer for it: what the emulated decode kernels
// (tests/kernels/emulated) are checked against.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/kv_format.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "emulated_block.h"
#include "kernels/backend.h"
#include "kernels/cuda/decode_attention.cuh"  // over the stand-in cuda_util.cuh
#include "tests/common/model/random_cache.h"
#include "tests/kernels/ops_test_util.h"

namespace kvwire::emulated {

struct BatchSeq {
  KvFormat format;  // kAuto: the cache in the dtype
  int kept, appended;
  int attend = 0;  // > 0: attend that many of each cache head's tokens (indices, any order)
  bool probs = false;
};
struct BatchCase {
  int d, group;
  DType dtype;
  size_t page_bytes;  // 0: caches in host regions
  std::vector<BatchSeq> batch;
};

class DecodeBatch {
 public:
  static constexpr int kCacheHeads = 2;

  // Builds the batch of `cs` and the reference's outputs; gtest failures where it cannot.
  void Build(const BatchCase& cs) {
    cs_ = cs;
    auto reference = kernels::MakeBackend(kernels::BackendKind::kReference);
    ASSERT_TRUE(reference.ok());
    if (cs.page_bytes > 0) {
      auto cpu = kernels::MakeBackend(kernels::BackendKind::kCpu, 1);
      ASSERT_TRUE(cpu.ok());
      auto made = KvPool::OnBackend(std::move(*cpu), size_t{64} << 20, cs.page_bytes);
      ASSERT_TRUE(made.ok()) << made.status();
      pool_ = std::move(*made);
    }
    std::mt19937 rng(static_cast<uint32_t>(cs.d * 7 + cs.group));
    const int n_heads = kCacheHeads * cs.group;
    for (const BatchSeq& sq : cs.batch) {
      caches_.push_back(RandomCache(sq.format, cs.dtype, cs.d, kCacheHeads, sq.kept, sq.appended,
                                    rng(), pool_.get(), /*size_every=*/97));
      ASSERT_NE(caches_.back(), nullptr);
      LayerCache& lc = caches_.back()->layer(0);
      for (int step = 0; step < sq.appended; ++step) {  // a coded cache codes a group at a time
        const std::vector<float> k = RandomRows(kCacheHeads, cs.d, rng),
                                 v = RandomRows(kCacheHeads, cs.d, rng, 0.5f);
        kernels::KvAppend a{k.data(), v.data(), lc.k, lc.v, lc.layout, lc.coding, sq.kept + step};
        ASSERT_TRUE((*reference)->AppendKv({&a, 1, kCacheHeads, kCacheHeads, cs.d, cs.dtype}).ok());
        lc.len = sq.kept + step + 1;
      }
      qs_.push_back(RandomRows(n_heads, cs.d, rng, 0.3f));
      std::vector<int32_t> indices;
      for (int c = 0; sq.attend > 0 && c < kCacheHeads; ++c) {
        std::vector<int32_t> all(lc.len);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        indices.insert(indices.end(), all.begin(), all.begin() + sq.attend);
      }
      indices_.push_back(std::move(indices));
      kernels::DecodeSequence s;
      s.q = qs_.back().data();
      s.k = lc.k;
      s.v = lc.v;
      s.layout = lc.layout;
      s.coding = lc.coding;
      s.len = lc.len;
      if (sq.attend > 0) {
        s.indices = indices_.back().data();
        s.num_indices = sq.attend;
      }
      seqs_.push_back(s);
    }
    p_.batch = static_cast<int>(seqs_.size());
    p_.n_heads = n_heads;
    p_.n_cache_heads = kCacheHeads;
    p_.head_dim = cs.d;
    p_.kv_dtype = cs.dtype;
    p_.scale = 1.f / std::sqrt(static_cast<float>(cs.d));
    p_.seqs = seqs_.data();
    Outputs(&want_, &want_probs_);
    ASSERT_TRUE((*reference)->DecodeAttention(p_).ok());
  }

  // The batch with fresh outputs (NaN) in *out and *probs, for a kernel to fill.
  const kernels::DecodeAttentionParams& Fresh(std::vector<std::vector<float>>* out,
                                              std::vector<std::vector<float>>* probs) {
    Outputs(out, probs);
    return p_;
  }

  // Expects out and probs (as Fresh made them) equal to the reference's.
  void Expect(const std::vector<std::vector<float>>& out,
              const std::vector<std::vector<float>>& probs) const {
    for (size_t b = 0; b < seqs_.size(); ++b) {
      const BatchSeq& sq = cs_.batch[b];
      SCOPED_TRACE(absl::StrCat("sequence ", b, " (", KvFormatName(sq.format), ", len ",
                                seqs_[b].len, sq.attend ? ", sparse" : "", ")"));
      EXPECT_TRUE(kernels::AllClose(out[b], want_[b], kernels::Tolerance{1e-5f, 1e-3f}));
      if (sq.probs) {
        EXPECT_TRUE(kernels::AllClose(probs[b], want_probs_[b], kernels::Tolerance{1e-6f, 1e-3f}));
      }
    }
  }

 private:
  void Outputs(std::vector<std::vector<float>>* out, std::vector<std::vector<float>>* probs) {
    const size_t n = static_cast<size_t>(p_.n_heads) * cs_.d;
    out->assign(seqs_.size(), {});
    probs->assign(seqs_.size(), {});
    for (size_t b = 0; b < seqs_.size(); ++b) {
      (*out)[b].assign(n, std::nanf(""));
      seqs_[b].out = (*out)[b].data();
      seqs_[b].probs = nullptr;
      if (cs_.batch[b].probs) {
        (*probs)[b].assign(static_cast<size_t>(p_.n_heads) * seqs_[b].len, std::nanf(""));
        seqs_[b].probs = (*probs)[b].data();
      }
    }
  }

  BatchCase cs_;
  std::unique_ptr<KvPool> pool_;
  std::vector<std::unique_ptr<KvCache>> caches_;
  std::vector<std::vector<float>> qs_;
  std::vector<std::vector<int32_t>> indices_;
  std::vector<kernels::DecodeSequence> seqs_;
  kernels::DecodeAttentionParams p_;
  std::vector<std::vector<float>> want_, want_probs_;
};

// A split's partials (LaunchMergeDecodeChunks' layout): for each of the batch's items (sequence,
// query head) and chunks its maximum, sum and unnormalised output, NaN until written; none
// (null) for one chunk.
struct Partials {
  Partials(const kernels::DecodeAttentionParams& p, int chunks) {
    if (chunks <= 1) return;
    const int64_t n = int64_t{p.batch} * p.n_heads * chunks;
    buffer.assign(n * (2 + p.head_dim), std::nanf(""));
    m = buffer.data();
    l = m + n;
    acc = l + n;
  }
  std::vector<float> buffer;
  float *m = nullptr, *l = nullptr, *acc = nullptr;
};

// decode_attention.cuh's MergeChunks over `chunks` partials of each item, on emulated blocks
// as LaunchMergeDecodeChunks launches it.
inline absl::Status MergeOnBlocks(const kernels::DecodeAttentionParams& p, int chunks,
                                  const float* part_m, const float* part_l, const float* part_acc,
                                  Order order) {
  namespace pd = kernels::cuda::plain_decode;
  const int64_t items = int64_t{p.batch} * p.n_heads;
  const Dim3 grid{static_cast<unsigned>((items + pd::kWarpsPerBlock - 1) / pd::kWarpsPerBlock), 1,
                  1};
  return kernels::cuda::DispatchHeadDim(p.head_dim, [&]<int DPL>() {
    return RunGrid(grid, 32 * pd::kWarpsPerBlock, order,
                   [&] {
                     pd::MergeChunks<DPL>(p.seqs, p.batch, p.n_heads, p.head_dim, chunks, part_m,
                                          part_l, part_acc);
                   })
               ? absl::OkStatus()
               : absl::InternalError("MergeChunks' threads deadlocked");
  });
}

}  // namespace kvwire::emulated
