// A decode step's attention, layer by layer: each sequence's new K/V row appended to its
// cache, its selector's choice of tokens, and decode attention over them. On a host backend
// the cache is the host's and each sparse cache head is selected and attended in one task;
// on a device backend the cache's rows are a device copy (DeviceKv), selected with the
// backend's ops.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/forward.h"
#include "kernels/coded_rows.h"

namespace kvwire {

using kernels::DecodeAttentionParams;
using kernels::DecodeSequence;

namespace {

// Token lc.len of every cache head: its position, and (k, v not null) its K and V rows, the
// float rows of the KV heads at k and v, stored in the cache's dtype (a cache kept per query
// head stores its KV head's row once per query head). Then the cache holds one more token.
void AppendToHostCache(LayerCache& lc, int n_kv_heads, const float* k, const float* v,
                       int32_t position) {
  const int heads_per_kv = lc.n_heads / n_kv_heads;
  const int t = lc.len;
  for (int ch = 0; ch < lc.n_heads; ++ch) {
    lc.positions[int64_t{ch} * lc.capacity + t] = position;
    if (k != nullptr) {
      const int64_t g = (ch / heads_per_kv) * int64_t{lc.head_dim};
      if (lc.coded()) {
        kernels::AppendCodedRow(lc.k, lc.v, lc.layout, lc.coding, lc.dtype, lc.head_dim, ch, t,
                                k + g, v + g);
      } else {
        FromFloat(lc.dtype, k + g, lc.k_row(ch, t), lc.head_dim);
        FromFloat(lc.dtype, v + g, lc.v_row(ch, t), lc.head_dim);
      }
    }
  }
  lc.len = t + 1;
}

// Cache head c of a coded host cache as a cache of one head (its rows, group parameters and
// residual), for attention over that head alone.
void HeadView(const LayerCache& lc, int c, DecodeSequence* one) {
  kernels::KvCoding coding = lc.coding;
  const size_t es = DTypeSize(lc.dtype);
  one->k = lc.k + c * lc.layout.head_stride;
  one->v = lc.v + c * lc.coding.v_layout.head_stride;
  one->layout = kernels::KvLayout::Region(lc.layout.head_stride);
  coding.k_params +=
      int64_t{c} * coding.max_groups * KvKeyGroupBytes(lc.coding.format, lc.head_dim);
  if (coding.v_scales != nullptr) coding.v_scales += int64_t{c} * coding.max_groups;
  const int64_t resid = int64_t{c} * coding.resid_tokens * lc.head_dim * static_cast<int64_t>(es);
  coding.k_resid = static_cast<uint8_t*>(coding.k_resid) + resid;
  coding.v_resid = static_cast<uint8_t*>(coding.v_resid) + resid;
  coding.v_layout = kernels::KvLayout::Region(lc.coding.v_layout.head_stride);
  one->coding = coding;
}

// The selector's plan for `layer` (over a cache that already holds the new token): 0 for
// dense attention, else the tokens each cache head attends.
absl::StatusOr<int> PlanSelection(DecodeSelector& selector, int layer, const LayerCache& lc) {
  int n = 0;
  ASSIGN_OR_RETURN(const bool sparse, selector.Plan(layer, lc, &n));
  if (!sparse) return 0;
  if (n <= 0 || n > lc.len) {
    return absl::InternalError("decode selector planned a malformed selection");
  }
  return n;
}

// Sequence b's attention over layer cache `lc`: its query and output rows in the step's
// activations (q|k|v rows of `stride` floats), and the cache's rows.
void AttendCache(const float* qkv, float* attn, int b, int64_t stride, int qd, const LayerCache& lc,
                 DecodeSequence& s) {
  s.q = qkv + b * stride;
  s.out = attn + int64_t{b} * qd;
  s.k = lc.k;
  s.v = lc.v;
  s.layout = lc.layout;
  s.coding = lc.coding;
  s.len = lc.len;
}

}  // namespace

// One layer's attention for a batch of sequences: each appends its new K/V row to its own
// cache (at its original position), its selector picks what it attends to (every sequence's
// cache heads at once, on the backend's threads; on a host backend each head is attended in
// the same task), and decode attention runs over the rest (every sequence, on a device
// backend; the dense ones on a host backend) in one call.
absl::Status LlamaModel::DecodeAttentionLayer(int li, absl::Span<const DecodeInput> batch,
                                              Activations& a, DecodeObserver* observer,
                                              DecodeTimes* times) {
  const ModelConfig& c = config_;
  const int bsz = static_cast<int>(batch.size()), d = c.head_dim;
  const int qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t stride = qd + 2 * kvd;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = times ? Clock::now() : Clock::time_point();
  std::vector<DecodeSequence> seqs(bsz);
  std::vector<std::vector<int32_t>> indices(bsz);
  std::vector<std::vector<float>> probs(observer ? bsz : 0);
  std::vector<std::pair<int, int>> heads;  // (sequence, cache head) to select for
  for (int b = 0; b < bsz; ++b) {
    LayerCache& lc = batch[b].cache->layer(li);
    const float* kr = a.qkv + b * stride + qd;
    AppendToHostCache(lc, c.num_kv_heads, kr, kr + kvd, batch[b].position);
    DecodeSequence& s = seqs[b];
    AttendCache(a.qkv, a.attn, b, stride, qd, lc, s);
    if (batch[b].selector) {
      ASSIGN_OR_RETURN(const int n, PlanSelection(*batch[b].selector, li, lc));
      if (n > 0) {
        indices[b].resize(static_cast<size_t>(lc.n_heads) * n);
        s.indices = indices[b].data();
        s.num_indices = n;
        for (int ch = 0; ch < lc.n_heads; ++ch) heads.emplace_back(b, ch);
      }
    }
    if (observer) {
      probs[b].resize(int64_t{c.num_heads} * lc.len);
      s.probs = probs[b].data();
    }
  }
  // On a host backend each sparse head is selected and attended in one task, on one thread:
  // the rows its selection chose (and prefetched) are still in that core's L2 when the kernel
  // reads them. Attended in a second pass they were mostly gone by then (the other heads'
  // summaries streamed through since), or in the other core's cache. A device backend attends
  // every sequence in one call after the host selection.
  const bool per_head = !heads.empty() && !on_device();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::mutex error_mu;
  absl::Status error;
  const bool timed = times && per_head;
  std::atomic<int64_t> select_ns{0}, attend_ns{0};  // thread time, when timed
  backend_->HostParallelFor(static_cast<int64_t>(heads.size()), [&](int64_t h0, int64_t h1) {
    int64_t selecting = 0, attending = 0;
    for (int64_t h = h0; h < h1; ++h) {
      const auto [b, ch] = heads[h];
      const LayerCache& lc = batch[b].cache->layer(li);
      const DecodeSequence& s = seqs[b];
      int32_t* out = indices[b].data() + static_cast<size_t>(ch) * s.num_indices;
      const Clock::time_point h_start = timed ? Clock::now() : Clock::time_point();
      batch[b].selector->SelectHead(li, s.q, lc, ch, out);
      if (!per_head) continue;
      const Clock::time_point h_selected = timed ? Clock::now() : h_start;
      // Cache head ch alone: its query heads, its rows, its selection.
      const int group = c.num_heads / lc.n_heads;
      DecodeSequence one;
      one.q = s.q + int64_t{ch} * group * d;
      one.out = s.out + int64_t{ch} * group * d;
      if (lc.coded()) {
        HeadView(lc, ch, &one);
      } else {
        one.k = lc.k_row(ch, 0);
        one.v = lc.v_row(ch, 0);
        one.layout = kernels::KvLayout::Region(lc.head_stride());
      }
      one.len = s.len;
      one.indices = out;
      one.num_indices = s.num_indices;
      one.probs = s.probs ? s.probs + int64_t{ch} * group * s.len : nullptr;
      DecodeAttentionParams dp;
      dp.seqs = &one;
      dp.batch = 1;
      dp.n_heads = group;
      dp.n_cache_heads = 1;
      dp.head_dim = d;
      dp.kv_dtype = lc.dtype;
      dp.scale = scale;
      if (absl::Status st = backend_->DecodeAttention(dp); !st.ok()) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (error.ok()) error = st;
      }
      if (timed) {
        const Clock::time_point h_end = Clock::now();
        selecting +=
            std::chrono::duration_cast<std::chrono::nanoseconds>(h_selected - h_start).count();
        attending +=
            std::chrono::duration_cast<std::chrono::nanoseconds>(h_end - h_selected).count();
      }
    }
    select_ns += selecting;
    attend_ns += attending;
  });
  RETURN_IF_ERROR(error);
  for (int b = 0; b < bsz; ++b) {
    if (batch[b].selector) {
      batch[b].selector->Done(li, seqs[b].q, batch[b].cache->layer(li), seqs[b].indices,
                              seqs[b].num_indices);
    }
  }
  const Clock::time_point t1 = times ? Clock::now() : t0;
  if (timed) {
    // The fused pass's wall time, split between selection and attention as its threads' time
    // was.
    const double wall = std::chrono::duration<double>(t1 - t0).count();
    const double sel = static_cast<double>(select_ns.load());
    const double all = sel + static_cast<double>(attend_ns.load());
    const double share = all > 0 ? sel / all : 1.0;
    times->selection_s += wall * share;
    times->attention_s += wall * (1 - share);
  } else if (times) {
    times->selection_s += std::chrono::duration<double>(t1 - t0).count();
  }
  // The sequences not attended above: all of them, or the dense ones.
  std::vector<int> rest;
  for (int b = 0; b < bsz; ++b) {
    if (!per_head || seqs[b].indices == nullptr) rest.push_back(b);
  }
  if (!rest.empty()) {
    std::vector<DecodeSequence> rest_seqs;
    for (int b : rest) rest_seqs.push_back(seqs[b]);
    DecodeAttentionParams dp;
    dp.seqs = rest_seqs.data();
    dp.batch = static_cast<int>(rest.size());
    dp.n_heads = c.num_heads;
    dp.n_cache_heads = batch[rest[0]].cache->shape().n_heads;
    dp.head_dim = d;
    dp.kv_dtype = batch[rest[0]].cache->shape().dtype;
    dp.scale = scale;
    bool uniform = true;
    for (int b : rest) {
      uniform &= batch[b].cache->shape().n_heads == dp.n_cache_heads &&
                 batch[b].cache->shape().dtype == dp.kv_dtype;
    }
    if (uniform) {
      RETURN_IF_ERROR(backend_->DecodeAttention(dp));
    } else {
      // Mixed cache layouts (per-KV-head and per-query-head) in one batch: one call each.
      for (size_t i = 0; i < rest.size(); ++i) {
        dp.seqs = &rest_seqs[i];
        dp.batch = 1;
        dp.n_cache_heads = batch[rest[i]].cache->shape().n_heads;
        dp.kv_dtype = batch[rest[i]].cache->shape().dtype;
        RETURN_IF_ERROR(backend_->DecodeAttention(dp));
      }
    }
    if (times) {
      RETURN_IF_ERROR(backend_->Synchronize());
      times->attention_s += std::chrono::duration<double>(Clock::now() - t1).count();
    }
  }
  if (observer) {
    for (int b = 0; b < bsz; ++b) observer->OnAttention(b, li, seqs[b].probs, seqs[b].len);
  }
  return absl::OkStatus();
}

absl::Status LlamaModel::SyncDeviceCaches(absl::Span<const DecodeInput> batch) {
  for (const DecodeInput& in : batch) RETURN_IF_ERROR(PrepareForDecode(*in.cache));
  return absl::OkStatus();
}

// A device model decodes only caches whose rows are in its backend's memory (a KvPool on it):
// the wire wrote the prompt's rows into their pages, and decode appends there. Nothing is
// copied or allocated here.
absl::Status LlamaModel::PrepareForDecode(KvCache& cache) {
  if (!on_device()) return absl::OkStatus();
  if (cache.backend() != backend_.get() || !cache.layer(0).paged()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this KV cache is not in the ", kernels::BackendName(backend_->kind()),
        " backend's memory; a device model decodes caches made in a KV pool on its backend "
        "(LlamaModel::NewCache, KvPool::OnBackend)"));
  }
  return absl::OkStatus();
}

// One layer's attention for a batch on a device, over caches in the backend's pool: each
// sequence's new K/V row appended to its pages (AppendKv), its selection, then decode attention,
// every sequence of one cache layout in one call. A selector describes its selection as the
// backend's ops (PlanOnBackend), which run for every sparse sequence at once (summary updates,
// page scores, top-k): nothing crosses to the host. A selector that selects only on the host
// (one that wraps another to watch its choices, for the evals) cannot: its host rows are not
// there, and it is refused.
absl::Status LlamaModel::DecodeAttentionLayerOnDevice(int li, absl::Span<const DecodeInput> batch,
                                                      Activations& a, DecodeTimes* times) {
  const ModelConfig& c = config_;
  const int bsz = static_cast<int>(batch.size()), d = c.head_dim;
  const int qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t stride = qd + 2 * kvd;
  using Clock = std::chrono::steady_clock;
  // Timed, each part waits for the device before and after it, so that the selection's time
  // is its work on the device, not the time to queue it (nor the projections queued before).
  if (times) RETURN_IF_ERROR(backend_->Synchronize());
  const Clock::time_point t0 = Clock::now();
  std::vector<kernels::KvAppend> appends(bsz);
  std::vector<DecodeSequence> seqs(bsz);
  std::vector<int> sparse;  // sequences the backend selects for
  for (int b = 0; b < bsz; ++b) {
    LayerCache& lc = batch[b].cache->layer(li);
    const int t = lc.len;
    // The host keeps the new token's position and the layer's length; the row goes to the
    // cache's pages (AppendKv, below).
    AppendToHostCache(lc, c.num_kv_heads, nullptr, nullptr, batch[b].position);
    if (DecodeSelector* selector = batch[b].selector) {
      if (!selector->SelectsOnBackend()) {
        return absl::UnimplementedError(absl::StrCat(
            "a decode selector that selects on the host (one that watches another's choices) "
            "reads the cache's rows, which ",
            kernels::BackendName(backend_->kind()), " keeps in device memory"));
      }
      ASSIGN_OR_RETURN(const int n, PlanSelection(*selector, li, lc));
      if (n > 0) {
        seqs[b].num_indices = n;
        sparse.push_back(b);
      }
    }
    const float* kr = a.qkv + b * stride + qd;
    appends[b] = {kr, kr + kvd, lc.k, lc.v, lc.layout, lc.coding, t};
    DecodeSequence& s = seqs[b];
    AttendCache(a.qkv, a.attn, b, stride, qd, lc, s);
  }
  // Sequences grouped by cache layout (per KV head or per query head, dtype); each group's new
  // rows appended first, since the selection reads them.
  std::vector<std::vector<int>> groups;
  std::vector<bool> grouped(bsz, false);
  for (int b0 = 0; b0 < bsz; ++b0) {
    if (grouped[b0]) continue;
    const KvCacheShape& shape = batch[b0].cache->shape();
    groups.emplace_back();
    std::vector<kernels::KvAppend> group_appends;
    for (int b = b0; b < bsz; ++b) {
      const KvCacheShape& sb = batch[b].cache->shape();
      if (grouped[b] || sb.n_heads != shape.n_heads || sb.dtype != shape.dtype) continue;
      grouped[b] = true;
      groups.back().push_back(b);
      group_appends.push_back(appends[b]);
    }
    RETURN_IF_ERROR(
        backend_->AppendKv({group_appends.data(), static_cast<int>(group_appends.size()),
                            c.num_kv_heads, shape.n_heads, d, shape.dtype}));
  }
  if (!sparse.empty()) {
    BackendSelection all;
    for (int b : sparse) {
      BackendSelection one;
      RETURN_IF_ERROR(batch[b].selector->PlanOnBackend(backend_, li, batch[b].cache->layer(li),
                                                       seqs[b].q, &one));
      seqs[b].indices = one.indices;
      all.updates.insert(all.updates.end(), one.updates.begin(), one.updates.end());
      all.scores.insert(all.scores.end(), one.scores.begin(), one.scores.end());
      all.top_k.insert(all.top_k.end(), one.top_k.begin(), one.top_k.end());
    }
    if (!all.updates.empty()) {
      RETURN_IF_ERROR(
          backend_->UpdateSummaries({all.updates.data(), static_cast<int>(all.updates.size())}));
    }
    RETURN_IF_ERROR(backend_->PageScores(
        {all.scores.data(), static_cast<int>(all.scores.size()), d, kv_dtype()}));
    RETURN_IF_ERROR(backend_->TopK({all.top_k.data(), static_cast<int>(all.top_k.size()),
                                    /*ascending=*/false}));
  }
  if (times) RETURN_IF_ERROR(backend_->Synchronize());
  const Clock::time_point t1 = Clock::now();
  if (times) times->selection_s += std::chrono::duration<double>(t1 - t0).count();
  for (const std::vector<int>& group : groups) {
    const KvCacheShape& shape = batch[group[0]].cache->shape();
    std::vector<DecodeSequence> group_seqs;
    for (int b : group) group_seqs.push_back(seqs[b]);
    DecodeAttentionParams dp;
    dp.seqs = group_seqs.data();
    dp.batch = static_cast<int>(group_seqs.size());
    dp.n_heads = c.num_heads;
    dp.n_cache_heads = shape.n_heads;
    dp.head_dim = d;
    dp.kv_dtype = shape.dtype;
    dp.scale = 1.f / std::sqrt(static_cast<float>(d));
    RETURN_IF_ERROR(backend_->DecodeAttention(dp));
  }
  if (times) {
    RETURN_IF_ERROR(backend_->Synchronize());
    times->attention_s += std::chrono::duration<double>(Clock::now() - t1).count();
  }
  return absl::OkStatus();
}

}  // namespace kvwire
