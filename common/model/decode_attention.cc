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
      FromFloat(lc.dtype, k + g, lc.k_row(ch, t), lc.head_dim);
      FromFloat(lc.dtype, v + g, lc.v_row(ch, t), lc.head_dim);
    }
  }
  lc.len = t + 1;
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
    s.q = a.qkv + b * stride;
    s.out = a.attn + int64_t{b} * qd;
    s.k = lc.k;
    s.v = lc.v;
    s.head_stride = lc.head_stride();
    s.len = lc.len;
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
      one.k = lc.k_row(ch, 0);
      one.v = lc.v_row(ch, 0);
      one.head_stride = lc.head_stride();
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

namespace {

// A cache's rows in device memory, for a model on a GPU: per layer, K and V laid out as the
// host cache's ([n_heads, capacity, head_dim] in its dtype), and how many tokens per head
// are there. Rows the host cache holds beyond that (the prompt, written by the wire) are
// uploaded before the next step; rows appended by decode steps are written here only.
class DeviceKv final : public KvCache::Attachment {
 public:
  struct Layer {
    void* k = nullptr;
    void* v = nullptr;
    int len = 0;
  };
  explicit DeviceKv(std::shared_ptr<kernels::KernelBackend> backend)
      : backend_(std::move(backend)) {}
  ~DeviceKv() override {
    for (Layer& l : layers) {
      backend_->Free(l.k);
      backend_->Free(l.v);
    }
  }
  const kernels::KernelBackend* backend() const { return backend_.get(); }
  std::vector<Layer> layers;

 private:
  std::shared_ptr<kernels::KernelBackend> backend_;
};

}  // namespace

absl::Status LlamaModel::SyncDeviceCaches(absl::Span<const DecodeInput> batch) {
  for (const DecodeInput& in : batch) RETURN_IF_ERROR(PrepareForDecode(*in.cache));
  return absl::OkStatus();
}

absl::Status LlamaModel::PrepareForDecode(KvCache& cache) {
  if (!on_device()) return absl::OkStatus();
  auto* dev = dynamic_cast<DeviceKv*>(cache.attachment());
  if (cache.attachment() != nullptr && (dev == nullptr || dev->backend() != backend_.get())) {
    return absl::FailedPreconditionError(
        "this KV cache has been decoded by another model; a cache belongs to one model");
  }
  if (dev == nullptr) {
    auto fresh = std::make_unique<DeviceKv>(backend_);
    const size_t bytes = KvCache::BytesFor(cache.shape());
    for (int li = 0; li < cache.num_layers(); ++li) {
      const LayerCache& lc = cache.layer(li);
      const size_t half = static_cast<size_t>(lc.n_heads) * lc.head_stride() * DTypeSize(lc.dtype);
      DeviceKv::Layer l;
      for (void** p : {&l.k, &l.v}) {
        auto buffer = backend_->Allocate(half);
        if (!buffer.ok()) {
          // What was allocated so far is freed with `fresh`.
          fresh->layers.push_back(l);
          return absl::ResourceExhaustedError(absl::StrCat("no device memory for a KV cache of ",
                                                           bytes >> 20,
                                                           " MiB: ", buffer.status().message()));
        }
        *p = *buffer;
      }
      fresh->layers.push_back(l);
    }
    dev = fresh.get();
    cache.set_attachment(std::move(fresh));
  }
  // The host rows the device does not have yet, one contiguous run per cache head.
  for (int li = 0; li < cache.num_layers(); ++li) {
    const LayerCache& lc = cache.layer(li);
    DeviceKv::Layer& l = dev->layers[li];
    if (lc.len < l.len) {
      return absl::FailedPreconditionError("a KV cache lost rows that its device copy holds");
    }
    if (lc.len == l.len) continue;
    const size_t elem = DTypeSize(lc.dtype);
    if (l.len == 0) {
      // The first upload (the prompt): each of K and V in one copy, the heads' unused rows too.
      const size_t all = static_cast<size_t>(lc.n_heads) * lc.head_stride() * elem;
      RETURN_IF_ERROR(backend_->CopyToDevice(l.k, lc.k, all));
      RETURN_IF_ERROR(backend_->CopyToDevice(l.v, lc.v, all));
      l.len = lc.len;
      continue;
    }
    const size_t offset = static_cast<size_t>(l.len) * lc.head_dim * elem;
    const size_t bytes = static_cast<size_t>(lc.len - l.len) * lc.row_bytes();
    for (int ch = 0; ch < lc.n_heads; ++ch) {
      const size_t head = static_cast<size_t>(ch) * lc.head_stride() * elem;
      RETURN_IF_ERROR(backend_->CopyToDevice(static_cast<uint8_t*>(l.k) + head + offset,
                                             lc.k + head + offset, bytes));
      RETURN_IF_ERROR(backend_->CopyToDevice(static_cast<uint8_t*>(l.v) + head + offset,
                                             lc.v + head + offset, bytes));
    }
    l.len = lc.len;
  }
  return absl::OkStatus();
}

// One layer's attention for a batch on a device: each sequence's new K/V row appended to its
// device cache (AppendKv), its selection, then decode attention, every sequence of one cache
// layout in one call. A selector that SelectsOnBackend describes its selection as the
// backend's ops, which run for every such sequence at once over the device copies (summary
// updates, page scores, top-k): nothing crosses to the host. Any other selector (one that
// wraps another to watch it) selects on the host, as on the CPU backends: the layer's q and
// new K/V rows come back, the new row is also written to the host cache, and the chosen
// indices go to the device.
absl::Status LlamaModel::DecodeAttentionLayerOnDevice(int li, absl::Span<const DecodeInput> batch,
                                                      Activations& a, DecodeTimes* times) {
  const ModelConfig& c = config_;
  const int bsz = static_cast<int>(batch.size()), d = c.head_dim;
  const int qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t stride = qd + 2 * kvd;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  bool host_selection = false;
  for (const DecodeInput& in : batch) {
    host_selection |= in.selector != nullptr && !in.selector->SelectsOnBackend();
  }
  std::vector<float> qkv_host;
  const float* qkv = nullptr;  // the layer's rows on the host, for the host's selectors
  if (host_selection) {
    ASSIGN_OR_RETURN(qkv, HostView(a.qkv, static_cast<size_t>(bsz) * stride, &qkv_host));
  }
  std::vector<kernels::KvAppend> appends(bsz);
  std::vector<DecodeSequence> seqs(bsz);
  std::vector<std::vector<int32_t>> indices(bsz);  // the host's selections
  std::vector<std::pair<int, int>> heads;          // (sequence, cache head) the host selects
  std::vector<int> on_backend;                     // sequences the backend selects for
  for (int b = 0; b < bsz; ++b) {
    LayerCache& lc = batch[b].cache->layer(li);
    DeviceKv::Layer& l = static_cast<DeviceKv*>(batch[b].cache->attachment())->layers[li];
    const int t = lc.len;
    // The host rows are written only for a host selector (its page summaries read them); the
    // device copy's len follows once AppendKv has written the row there.
    DecodeSelector* selector = batch[b].selector;
    const bool host = selector != nullptr && !selector->SelectsOnBackend();
    const float* host_k = host ? qkv + b * stride + qd : nullptr;
    AppendToHostCache(lc, c.num_kv_heads, host_k, host_k ? host_k + kvd : nullptr,
                      batch[b].position);
    if (selector) {
      ASSIGN_OR_RETURN(const int n, PlanSelection(*selector, li, lc));
      if (n > 0) {
        seqs[b].num_indices = n;
        if (host) {
          indices[b].resize(static_cast<size_t>(lc.n_heads) * n);
          for (int ch = 0; ch < lc.n_heads; ++ch) heads.emplace_back(b, ch);
        } else {
          on_backend.push_back(b);
        }
      }
    }
    const float* kr = a.qkv + b * stride + qd;
    appends[b] = {kr, kr + kvd, l.k, l.v, lc.head_stride(), t};
    DecodeSequence& s = seqs[b];
    s.q = a.qkv + b * stride;
    s.out = a.attn + int64_t{b} * qd;
    s.k = l.k;
    s.v = l.v;
    s.head_stride = lc.head_stride();
    s.len = lc.len;
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
    for (int b : groups.back()) {
      static_cast<DeviceKv*>(batch[b].cache->attachment())->layers[li].len =
          batch[b].cache->layer(li).len;
    }
  }
  if (!on_backend.empty()) {
    BackendSelection all;
    for (int b : on_backend) {
      const LayerCache& lc = batch[b].cache->layer(li);
      BackendSelection one;
      RETURN_IF_ERROR(batch[b].selector->PlanOnBackend(backend_, li, lc, seqs[b].k,
                                                       lc.head_stride(), seqs[b].q, &one));
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
  if (!heads.empty()) {
    backend_->HostParallelFor(static_cast<int64_t>(heads.size()), [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) {
        const auto [b, ch] = heads[h];
        int32_t* out = indices[b].data() + static_cast<size_t>(ch) * seqs[b].num_indices;
        batch[b].selector->SelectHead(li, qkv + b * stride, batch[b].cache->layer(li), ch, out);
      }
    });
  }
  if (host_selection) {
    // The host's selections in one device buffer.
    size_t total = 0;
    for (const auto& ix : indices) total += ix.size();
    if (total * sizeof(int32_t) > sparse_indices_bytes_) {
      sparse_indices_.reset();
      sparse_indices_bytes_ = 0;
      ASSIGN_OR_RETURN(sparse_indices_, AllocateOnBackend(total * sizeof(int32_t)));
      sparse_indices_bytes_ = total * sizeof(int32_t);
    }
    std::vector<int32_t> packed;
    packed.reserve(total);
    for (int b = 0; b < bsz; ++b) {
      DecodeSelector* selector = batch[b].selector;
      if (selector == nullptr || selector->SelectsOnBackend()) continue;
      selector->Done(li, qkv + b * stride, batch[b].cache->layer(li),
                     indices[b].empty() ? nullptr : indices[b].data(), seqs[b].num_indices);
      if (indices[b].empty()) continue;
      seqs[b].indices = static_cast<const int32_t*>(sparse_indices_.get()) + packed.size();
      packed.insert(packed.end(), indices[b].begin(), indices[b].end());
    }
    if (!packed.empty()) {
      RETURN_IF_ERROR(backend_->CopyToDevice(sparse_indices_.get(), packed.data(),
                                             packed.size() * sizeof(int32_t)));
    }
  }
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
