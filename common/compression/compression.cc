#include "common/compression/compression.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

// "compression: <what>", about `param` when one is named (RenameParams renames it).
absl::Status Bad(absl::string_view what, absl::string_view param = "") {
  absl::Status st = absl::InvalidArgumentError(absl::StrCat("compression: ", what));
  return param.empty() ? st : AboutParam(std::move(st), param);
}

bool IsShared(absl::string_view name) {
  for (const char* s : kSharedCompressionParams) {
    if (name == s) return true;
  }
  return false;
}

absl::Status ParseInt(absl::string_view name, const std::string& value, int* out) {
  if (!absl::SimpleAtoi(value, out)) {
    return ParamError(name, absl::StrCat("must be an integer, got '", value, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CompressionConfig::Validate() const {
  if (budget < 0) return Bad(absl::StrCat("budget must be >= 0, got ", budget), "budget");
  if (!(ratio >= 0 && ratio <= 1)) {
    return Bad(absl::StrCat("ratio must be in (0, 1] (kept / prompt tokens), got ", ratio),
               "ratio");
  }
  // Upper bounds keep every sum below int overflow and every buffer sane; the window also
  // bounds the score buffer (heads × window × prompt floats per layer).
  if (budget > (1 << 30))
    return Bad(absl::StrCat("budget must be <= 2^30, got ", budget), "budget");
  if (window > kMaxWindow) {
    return Bad(absl::StrCat("window must be <= ", kMaxWindow,
                            " (observation windows are 16-128 tokens in the papers), got ", window),
               "window");
  }
  if (skip_layers > (1 << 20)) {
    return Bad(absl::StrCat("skip_layers must be <= 2^20, got ", skip_layers), "skip_layers");
  }
  if (!policy->evicts()) return absl::OkStatus();
  if (budget == 0 && ratio == 0) {
    return Bad(absl::StrCat("budget (tokens kept per head) or ratio is needed by ", policy->name()),
               "budget");
  }
  if (skip_layers < 0) {
    return Bad(absl::StrCat("skip_layers must be >= 0, got ", skip_layers), "skip_layers");
  }
  if (window < 1) return Bad(absl::StrCat("window must be >= 1, got ", window), "window");
  // The policy's own budget rules ("budget (8) must exceed the observation window (16) ...").
  if (absl::Status st = policy->CheckBudget(budget, window); !st.ok()) {
    return Bad(st.message(), "budget");
  }
  return absl::OkStatus();
}

absl::Status CompressionConfig::ValidateFor(int num_layers, int head_dim) const {
  if (absl::Status st = CheckKvFormat(kv_format, head_dim); !st.ok()) {
    return Bad(st.message(), "kv_format");
  }
  if (policy->evicts() && skip_layers >= num_layers) {
    return Bad(
        absl::StrCat("skip_layers (", skip_layers, ") must be below the model's layer count (",
                     num_layers, "): it would leave no layer to compress"),
        "skip_layers");
  }
  return absl::OkStatus();
}

int CompressionConfig::EffectiveBudget(int len) const {
  if (!policy->evicts()) return len;
  if (budget > 0) return budget;
  return std::max(policy->MinBudget(window), static_cast<int>(std::floor(ratio * len)));
}

bool CompressionConfig::Compresses(int len) const {
  return policy->evicts() && len > EffectiveBudget(len);
}

int CompressionConfig::KeptTokens(int layer, int len) const {
  // A two-stage policy (rocketkv) is resolved before a prompt is compressed.
  KVWIRE_CHECK(policy->selects() || !policy->evicts());
  if (layer < skip_layers || !Compresses(len)) return len;
  return EffectiveBudget(len);
}

int CompressionConfig::CacheHeads(int n_heads, int n_kv_heads) const {
  return policy->CacheHeads(n_heads, n_kv_heads);
}

bool CompressionConfig::NeedsScores() const { return policy->evicts() && policy->uses_scores(); }

std::string CompressionConfig::Describe() const {
  const std::string format =
      kv_format == KvFormat::kAuto ? "" : absl::StrCat(" in ", KvFormatName(kv_format));
  if (!policy->evicts()) return absl::StrCat(policy->name(), format);
  std::string s = absl::StrCat(policy->name(), "(", policy->DescribeBudget(budget, ratio),
                               policy->DescribeParams(window));
  if (skip_layers > 0) absl::StrAppend(&s, ", skip_layers=", skip_layers);
  return absl::StrCat(s, ")", format);
}

absl::Status ApplyCompressionValues(const ParamValues& values, CompressionConfig* config) {
  CompressionConfig c = *config;
  ParamValues own = c.policy->params();
  if (auto it = values.find("policy"); it != values.end()) {
    const PolicyInfo* info = FindPolicy(it->second);
    if (info == nullptr) {
      return ParamError("policy",
                        absl::StrCat("must be one of ", PolicyNames(), "; got '", it->second, "'"));
    }
    if (info->name != c.policy->name()) {
      // Another policy than the current one: its parameters start at their defaults, and
      // the current budget does not carry over.
      own.clear();
      c.budget = 0;
      c.ratio = 0;
      ASSIGN_OR_RETURN(c.policy, MakePolicy(info->name));
    }
  }
  if (values.count("budget") && values.count("ratio") && values.at("budget") != "0" &&
      values.at("ratio") != "0") {
    return AboutParam(
        absl::InvalidArgumentError(
            "compression: budget and ratio are both set; give one (budget: tokens kept per "
            "KV head; ratio: kept / prompt tokens)"),
        "budget");
  }
  bool policy_params = false;
  for (const auto& [name, value] : values) {
    if (name == "policy") continue;
    if (name == "budget") {
      RETURN_IF_ERROR(ParseInt(name, value, &c.budget));
      if (values.count("ratio") == 0) c.ratio = 0;
    } else if (name == "ratio") {
      if (!absl::SimpleAtod(value, &c.ratio)) {
        return ParamError("ratio", absl::StrCat("must be a number, got '", value, "'"));
      }
      if (values.count("budget") == 0) c.budget = 0;
    } else if (name == "window") {
      RETURN_IF_ERROR(ParseInt(name, value, &c.window));
    } else if (name == "skip_layers") {
      RETURN_IF_ERROR(ParseInt(name, value, &c.skip_layers));
    } else if (name == "kv_format") {
      auto format = ParseKvFormat(value);
      if (!format.ok()) return ParamError(name, format.status().message());
      c.kv_format = *format;
    } else {
      own[name] = value;
      policy_params = true;
    }
  }
  if (!c.policy->evicts()) {
    for (const auto& [name, value] : values) {
      if (IsShared(name)) {
        return ParamError(name, absl::StrCat("does not apply to ", c.policy->name(),
                                             ", which keeps every prompt token"));
      }
    }
  }
  if (policy_params) {
    ASSIGN_OR_RETURN(c.policy, MakePolicy(c.policy->name(), own));
  }
  RETURN_IF_ERROR(c.Validate());
  *config = std::move(c);
  return absl::OkStatus();
}

ParamValues CompressionValues(const CompressionConfig& c) {
  ParamValues v = c.policy->params();
  v["policy"] = std::string(c.policy->name());
  if (c.kv_format != KvFormat::kAuto) v["kv_format"] = std::string(KvFormatName(c.kv_format));
  if (!c.policy->evicts()) return v;
  if (c.budget > 0) {
    v["budget"] = absl::StrCat(c.budget);
  } else {
    v["ratio"] = ExactDecimal(c.ratio);
  }
  v["window"] = absl::StrCat(c.window);
  if (c.skip_layers > 0) v["skip_layers"] = absl::StrCat(c.skip_layers);
  return v;
}

LayerSelector::LayerSelector(const CompressionConfig& config, int n_heads, int n_kv_heads)
    : config_(config), n_heads_(n_heads), n_kv_heads_(n_kv_heads) {}

LayerSelector::~LayerSelector() { Release(); }

void LayerSelector::Release() {
  if (backend_ == nullptr) return;
  for (void* p : {static_cast<void*>(ops_.votes), static_cast<void*>(ops_.pooled),
                  static_cast<void*>(ops_.kept), static_cast<void*>(ops_.carried),
                  static_cast<void*>(all_)}) {
    if (p != nullptr) backend_->Free(p);
  }
  ops_ = SelectionOps{};
  all_ = nullptr;
  backend_ = nullptr;
  reserved_len_ = -1;
}

absl::Status LayerSelector::Reserve(kernels::KernelBackend& backend, int len) {
  if (backend_ == &backend && reserved_len_ == len) return absl::OkStatus();
  if (backend_ != nullptr && state_.has_carried) {
    return absl::FailedPreconditionError(
        "a prompt's layers must be compressed on one backend, at one length");
  }
  Release();
  backend_ = &backend;
  reserved_len_ = len;
  ops_.backend = &backend;
  const int heads = cache_heads();
  auto alloc = [&](size_t bytes) -> absl::StatusOr<void*> {
    auto p = backend.Allocate(std::max<size_t>(bytes, 1));
    if (!p.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("compression buffers for a ", len, "-token prompt: ", p.status().message()));
    }
    return *p;
  };
  // Every position of every head, for the layers kept whole: uploaded once per prompt.
  if (config_.skip_layers > 0 || !config_.Compresses(len)) {
    std::vector<int32_t> all(static_cast<size_t>(heads) * len);
    for (int c = 0; c < heads; ++c) {
      std::iota(all.begin() + int64_t{c} * len, all.begin() + int64_t{c + 1} * len, 0);
    }
    ASSIGN_OR_RETURN(void* a, alloc(all.size() * sizeof(int32_t)));
    all_ = static_cast<int32_t*>(a);
    RETURN_IF_ERROR(backend.CopyToDevice(all_, all.data(), all.size() * sizeof(int32_t)));
  }
  if (!config_.Compresses(len)) return absl::OkStatus();
  const size_t scores = static_cast<size_t>(n_heads_) * (len - config_.window);
  const size_t kept = static_cast<size_t>(heads) * config_.EffectiveBudget(len);
  ASSIGN_OR_RETURN(void* votes, alloc(scores * sizeof(float)));
  ops_.votes = static_cast<float*>(votes);
  ASSIGN_OR_RETURN(void* pooled, alloc(scores * sizeof(float)));
  ops_.pooled = static_cast<float*>(pooled);
  ASSIGN_OR_RETURN(void* k, alloc(kept * sizeof(int32_t)));
  ops_.kept = static_cast<int32_t*>(k);
  ASSIGN_OR_RETURN(void* carried, alloc(kept * sizeof(int32_t)));
  ops_.carried = static_cast<int32_t*>(carried);
  return absl::OkStatus();
}

bool LayerSelector::NeedsScoresFor(int layer, int len) const {
  if (!config_.NeedsScores() || layer < config_.skip_layers || !config_.Compresses(len)) {
    return false;
  }
  return config_.policy->NeedsScores(layer - config_.skip_layers);
}

absl::StatusOr<const int32_t*> LayerSelector::SelectOn(kernels::KernelBackend& backend, int layer,
                                                       int len, const WindowScores* scores,
                                                       int* count) {
  const CompressionConfig& c = config_;
  RETURN_IF_ERROR(Reserve(backend, len));
  if (layer < c.skip_layers || !c.Compresses(len)) {
    *count = len;
    return all_;
  }
  LayerInput in;
  in.layer = layer;
  in.index = layer - c.skip_layers;
  in.len = len;
  in.window = c.window;
  in.n_heads = n_heads_;
  in.n_kv_heads = n_kv_heads_;
  in.cache_heads = cache_heads();
  in.prefix = len - c.window;
  in.prefix_budget = c.EffectiveBudget(len) - c.window;
  if (NeedsScoresFor(layer, len)) {
    if (scores == nullptr || scores->data == nullptr || scores->len != len ||
        scores->window != c.window || scores->n_heads != n_heads_) {
      return absl::InternalError(absl::StrCat(c.policy->name(), " needs window scores [", n_heads_,
                                              ", ", c.window, ", ", len, "]"));
    }
    in.scores = scores;
  }
  *count = in.prefix_budget + in.window;
  return c.policy->Select(in, ops_, &state_);
}

Compressor::Compressor(const CompressionConfig& config, const ModelConfig& model, DType kv_dtype,
                       CompressedLayerSink* sink)
    : config_(config),
      n_heads_(model.num_heads),
      n_kv_heads_(model.num_kv_heads),
      head_dim_(model.head_dim),
      kv_dtype_(kv_dtype),
      selector_(config, model.num_heads, model.num_kv_heads),
      sink_(sink) {}

Compressor::~Compressor() {
  // A prefill that stopped early (cancelled, past its deadline) leaves its last copies.
  if (has_pending_) {
    for (kernels::KernelBackend::CopyTicket t : tickets_) (void)backend_->WaitCopy(t);
  }
  ReleaseSendBuffers();
}

absl::Status Compressor::Deliver() {
  if (!has_pending_) return absl::OkStatus();
  has_pending_ = false;
  absl::Status st;
  for (kernels::KernelBackend::CopyTicket t : tickets_) {
    if (absl::Status w = backend_->WaitCopy(t); st.ok()) st = w;
  }
  tickets_.clear();
  RETURN_IF_ERROR(st);
  return sink_->Accept(std::move(pending_));
}

absl::Status Compressor::Finish() { return Deliver(); }

void Compressor::ReleaseSendBuffers() {
  if (backend_ == nullptr) return;
  backend_->Free(k_out_);
  backend_->Free(v_out_);
  k_out_ = v_out_ = nullptr;
  out_bytes_ = 0;
  backend_ = nullptr;
}

// Only a prompt that will be compressed needs scores (their buffer is heads × w × L floats).
int Compressor::window(int len) const {
  return config_.NeedsScores() && config_.Compresses(len) ? config_.window : 0;
}

bool Compressor::NeedsScores(int layer, int len) const {
  return selector_.NeedsScoresFor(layer, len);
}

absl::Status Compressor::OnLayer(const PrefillLayer& layer) {
  const auto t0 = std::chrono::steady_clock::now();
  if (layer.backend == nullptr) {
    return absl::InternalError("a prefill layer must name the backend whose memory it is in");
  }
  kernels::KernelBackend& backend = *layer.backend;
  // The previous layer's copies first: this layer's selection and gather reuse its buffers.
  RETURN_IF_ERROR(Deliver());
  WindowScores ws{layer.window_scores, n_heads_, layer.window, layer.len};
  const bool need = selector_.NeedsScoresFor(layer.layer, layer.len);
  int count = 0;
  ASSIGN_OR_RETURN(const int32_t* kept, selector_.SelectOn(backend, layer.layer, layer.len,
                                                           need ? &ws : nullptr, &count));
  // The gather, for every policy: kept rows of K and V in the cache dtype, on the backend.
  CompressedLayer out;
  out.layer = layer.layer;
  out.n_heads = selector_.cache_heads();
  out.head_dim = head_dim_;
  out.count = count;
  out.dtype = kv_dtype_;
  const size_t bytes = static_cast<size_t>(out.n_heads) * count * head_dim_ * DTypeSize(kv_dtype_);
  if (backend_ != &backend || out_bytes_ < bytes) {
    ReleaseSendBuffers();
    ASSIGN_OR_RETURN(k_out_, backend.Allocate(bytes));
    auto v = backend.Allocate(bytes);
    if (!v.ok()) {
      backend.Free(k_out_);
      k_out_ = nullptr;
      return v.status();
    }
    v_out_ = *v;
    backend_ = &backend;
    out_bytes_ = bytes;
  }
  kernels::GatherKvParams g;
  g.k = layer.k;
  g.v = layer.v;
  g.kv_stride = layer.kv_stride;
  g.kept = kept;
  g.len = layer.len;
  g.n_cache_heads = out.n_heads;
  g.n_kv_heads = n_kv_heads_;
  g.head_dim = head_dim_;
  g.count = count;
  g.dtype = kv_dtype_;
  g.k_out = k_out_;
  g.v_out = v_out_;
  RETURN_IF_ERROR(backend.GatherKv(g));
  // What crosses to the host: the kept positions and rows, nothing else. On a device the copies
  // run while the next layer computes, and the layer reaches the sink when the next one (or
  // Finish) begins; a host backend's are done at once and the layer goes now.
  out.positions.resize(static_cast<size_t>(out.n_heads) * count);
  out.k.resize(bytes);
  out.v.resize(bytes);
  pending_ = std::move(out);
  has_pending_ = true;
  for (auto [dst, src, n] :
       {std::tuple<void*, const void*, size_t>{pending_.positions.data(), kept,
                                               pending_.positions.size() * sizeof(int32_t)},
        {pending_.k.data(), k_out_, bytes},
        {pending_.v.data(), v_out_, bytes}}) {
    auto ticket = backend.CopyToHostAsync(dst, src, n);
    if (!ticket.ok()) {
      for (kernels::KernelBackend::CopyTicket t : tickets_) (void)backend.WaitCopy(t);
      tickets_.clear();
      has_pending_ = false;
      return ticket.status();
    }
    tickets_.push_back(*ticket);
  }
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return backend.host_addressable() ? Deliver() : absl::OkStatus();
}

KvCacheShape CompressedCacheShape(const CompressionConfig& config, const ModelConfig& model,
                                  DType kv_dtype, int len, int extra_tokens) {
  KvCacheShape shape;
  shape.n_heads = config.CacheHeads(model.num_heads, model.num_kv_heads);
  shape.head_dim = model.head_dim;
  shape.dtype = kv_dtype;
  for (int l = 0; l < model.num_layers; ++l) {
    shape.capacity.push_back(config.KeptTokens(l, len) + extra_tokens);
  }
  shape.appended = extra_tokens;
  return shape;
}

KvFormat DecodeCacheFormat(KvFormat wire) { return KvCoded(wire) ? wire : KvFormat::kAuto; }

absl::Status StoreLayer(const CompressedLayer& layer, KvCache* cache) {
  if (layer.layer < 0 || layer.layer >= cache->num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer.layer, " outside the cache's ",
                                                   cache->num_layers(), " layers"));
  }
  LayerCache& lc = cache->layer(layer.layer);
  if (layer.n_heads != lc.n_heads || layer.head_dim != lc.head_dim || layer.dtype != lc.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer.layer, " has ", layer.n_heads, " heads x ", layer.head_dim,
                     " ", DTypeName(layer.dtype), " but the cache expects ", lc.n_heads, " x ",
                     lc.head_dim, " ", DTypeName(lc.dtype)));
  }
  if (layer.count > lc.capacity) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer.layer, " has ", layer.count,
                                                   " tokens per head but the cache holds ",
                                                   lc.capacity));
  }
  const size_t row = lc.row_bytes();
  const size_t head_bytes = static_cast<size_t>(layer.count) * row;
  if (layer.k.size() != head_bytes * layer.n_heads || layer.v.size() != layer.k.size() ||
      layer.positions.size() != static_cast<size_t>(layer.count) * layer.n_heads) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer.layer,
                                                   " payload sizes do not "
                                                   "match its shape"));
  }
  for (int c = 0; c < lc.n_heads; ++c) {
    RETURN_IF_ERROR(cache->WriteRows(layer.layer, c, 0, layer.count,
                                     layer.k.data() + c * head_bytes,
                                     layer.v.data() + c * head_bytes));
    std::memcpy(lc.positions + int64_t{c} * lc.capacity,
                layer.positions.data() + int64_t{c} * layer.count, layer.count * sizeof(int32_t));
  }
  lc.len = layer.count;
  return absl::OkStatus();
}

}  // namespace kvwire
