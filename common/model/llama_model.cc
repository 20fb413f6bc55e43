#include "common/model/llama_model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "common/model/forward.h"
#include "common/model/safetensors.h"

namespace kvwire {
namespace {

using kernels::DecodeAttentionParams;
using kernels::DecodeSequence;
using kernels::MatMulParams;
using kernels::PrefillAttentionParams;
using kernels::RmsNormParams;
using kernels::RopeParams;
using kernels::SwiGluParams;

// Rows of the MLP computed at once during prefill: bounds the [rows, 2·ffn] buffer.
constexpr int kMlpRowChunk = 256;

}  // namespace

LlamaModel::~LlamaModel() = default;

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& spec,
                                                             const LoadOptions& options) {
  std::unique_ptr<LlamaModel> model(new LlamaModel());
  model->options_ = options;
  ASSIGN_OR_RETURN(model->backend_, kernels::MakeBackend(options.backend, options.threads,
                                                         options.device_memory_bytes));
  if (options.mapped_weights && model->on_device()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mapped weights apply to the host backends (cpu, reference), not ",
                     kernels::BackendName(options.backend),
                     ", whose kernels read only the backend's own memory"));
  }
  if (spec.rfind("synthetic:", 0) == 0) {
    RETURN_IF_ERROR(model->LoadSynthetic(spec, options));
  } else {
    RETURN_IF_ERROR(model->LoadFromFolder(spec, options));
  }
  model->inv_freq_ = model->config_.RopeInvFreq();
  model->ComputeFingerprint();
  RETURN_IF_ERROR(model->PlaceWeights(options.mapped_weights));
  return model;
}

absl::StatusOr<KvAllocator*> LlamaModel::CacheAllocator() {
  if (!on_device()) return &HeapKvAllocator();
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (kv_pool_ == nullptr) {
    ASSIGN_OR_RETURN(kv_pool_,
                     KvPool::OnBackend(backend_, options_.kv_pool_bytes, options_.kv_page_bytes));
  }
  return kv_pool_.get();
}

absl::StatusOr<std::unique_ptr<KvCache>> LlamaModel::NewCache(const KvCacheShape& shape) {
  ASSIGN_OR_RETURN(KvAllocator * allocator, CacheAllocator());
  if (!on_device()) return KvCache::Create(shape, *allocator);
  return KvCache::CreatePaged(shape, *static_cast<KvPool*>(allocator));
}

absl::StatusOr<LlamaModel::BackendPtr> LlamaModel::AllocateOnBackend(size_t bytes) {
  ASSIGN_OR_RETURN(void* p, backend_->Allocate(bytes));
  return BackendPtr(p, BackendFree{backend_.get()});
}

absl::Status LlamaModel::PlaceWeights(bool mapped) {
  embed_host_ = embed_.w;
  if (mapped) {  // a host backend (Load checked), reading the weights where they are
    for (Layer& l : layers_) {
      l.attn_norm_w = l.attn_norm.data();
      l.mlp_norm_w = l.mlp_norm.data();
    }
    final_norm_w_ = final_norm_.data();
    inv_freq_w_ = inv_freq_.data();
    return absl::OkStatus();
  }
  // On the host backends this is a copy too: from a mapped file's 4 KiB pages into the
  // backend's buffers, which are on huge pages (host_alloc.h), which decode at batch 1 streams
  // faster (docs/benchmarks.md, "Weights on huge pages"). The cost is the copy at load, and the
  // memory: anonymous, where a mapping's pages are the page cache's.
  // Each host array once (the LM head may be the embedding).
  std::map<const void*, const void*> placed;
  const int64_t total = WeightBytes();
  auto allocate = [&](size_t bytes) -> absl::StatusOr<uint8_t*> {
    auto buffer = AllocateOnBackend(bytes);
    if (!buffer.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the model's ", total >> 20, " MiB of weights do not fit in ",
          kernels::BackendName(backend_->kind()), " backend memory: ", buffer.status().message()));
    }
    placed_.push_back(std::move(*buffer));
    return static_cast<uint8_t*>(placed_.back().get());
  };
  auto upload = [&](const void* host, size_t bytes) -> absl::StatusOr<const void*> {
    if (auto it = placed.find(host); it != placed.end()) return it->second;
    ASSIGN_OR_RETURN(uint8_t * buffer, allocate(bytes));
    RETURN_IF_ERROR(backend_->CopyToDevice(buffer, host, bytes));
    placed[host] = buffer;
    return buffer;
  };
  auto place_linear = [&](Linear& l) -> absl::Status {
    ASSIGN_OR_RETURN(l.w, upload(l.w, static_cast<size_t>(l.out) * l.in * DTypeSize(l.dtype)));
    if (l.bias) {
      ASSIGN_OR_RETURN(const void* b, upload(l.bias, l.out * sizeof(float)));
      l.bias = static_cast<const float*>(b);
    }
    return absl::OkStatus();
  };
  auto place_floats = [&](const std::vector<float>& v) -> absl::StatusOr<const float*> {
    ASSIGN_OR_RETURN(const void* p, upload(v.data(), v.size() * sizeof(float)));
    return static_cast<const float*>(p);
  };
  // Projections that read the same input placed as one matrix, their rows one after another
  // (and their biases, a missing one as zeros), so that one product computes them all: fewer,
  // larger GEMMs (one launch instead of three on a GPU). Each part stays a view into it.
  auto place_fused = [&](std::initializer_list<Linear*> parts, Linear* fused) -> absl::Status {
    Linear f = *parts.begin()[0];
    f.out = 0;
    bool bias = false;
    for (const Linear* x : parts) {
      if (x->dtype != f.dtype || x->in != f.in) {  // not one matrix: each on its own
        for (Linear* y : parts) RETURN_IF_ERROR(place_linear(*y));
        return absl::OkStatus();
      }
      f.out += x->out;
      bias = bias || x->bias != nullptr;
    }
    const size_t row = static_cast<size_t>(f.in) * DTypeSize(f.dtype);
    ASSIGN_OR_RETURN(uint8_t * w, allocate(row * f.out));
    std::vector<float> biases(bias ? f.out : 0, 0.f);
    size_t at = 0;
    for (Linear* x : parts) {
      RETURN_IF_ERROR(backend_->CopyToDevice(w + at * row, x->w, row * x->out));
      if (x->bias) std::copy_n(x->bias, x->out, biases.begin() + at);
      x->w = w + at * row;
      at += x->out;
    }
    f.w = w;
    f.bias = nullptr;
    if (bias) {  // (the copy is taken now: biases may go)
      ASSIGN_OR_RETURN(uint8_t * b, allocate(biases.size() * sizeof(float)));
      RETURN_IF_ERROR(backend_->CopyToDevice(b, biases.data(), biases.size() * sizeof(float)));
      f.bias = reinterpret_cast<const float*>(b);
      at = 0;
      for (Linear* x : parts) {
        x->bias = x->bias ? f.bias + at : nullptr;
        at += x->out;
      }
    }
    *fused = f;
    return absl::OkStatus();
  };
  for (Layer& l : layers_) {
    RETURN_IF_ERROR(place_fused({&l.q, &l.k, &l.v}, &l.qkv));
    RETURN_IF_ERROR(place_fused({&l.gate, &l.up}, &l.gate_up));
    for (Linear* x : {&l.o, &l.down}) RETURN_IF_ERROR(place_linear(*x));
    ASSIGN_OR_RETURN(l.attn_norm_w, place_floats(l.attn_norm));
    ASSIGN_OR_RETURN(l.mlp_norm_w, place_floats(l.mlp_norm));
  }
  RETURN_IF_ERROR(place_linear(lm_head_));
  ASSIGN_OR_RETURN(final_norm_w_, place_floats(final_norm_));
  ASSIGN_OR_RETURN(inv_freq_w_, place_floats(inv_freq_));
  // A device looks tokens up in its own copy of the embedding (EmbedRows: 4 bytes a token
  // cross, not a row), the LM head's where they are tied; a host backend reads the host's rows
  // (EmbedRow). embed_.w names the device copy where it is also the LM head.
  if (!backend_->host_addressable()) {
    ASSIGN_OR_RETURN(embed_device_,
                     upload(embed_host_, static_cast<size_t>(config_.vocab_size) *
                                             config_.hidden_size * DTypeSize(embed_.dtype)));
  }
  if (auto it = placed.find(embed_.w); it != placed.end()) embed_.w = it->second;
  // The host copies of the projections are no longer read: the synthetic ones are freed (a
  // mapped file's pages are the page cache's).
  for (auto it = owned_.begin(); it != owned_.end();) {
    it = it->data() == embed_host_ ? std::next(it) : owned_.erase(it);
  }
  return backend_->Synchronize();
}

void LlamaModel::ComputeFingerprint() {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64
  auto mix = [&](const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  const ModelConfig& c = config_;
  const std::string shape =
      absl::StrCat(c.model_type, "/", c.num_layers, "/", c.hidden_size, "/", c.num_heads, "/",
                   c.num_kv_heads, "/", c.head_dim, "/", c.intermediate_size, "/", c.vocab_size,
                   "/", c.rope_theta, "/", DTypeName(kv_dtype()));
  mix(shape.data(), shape.size());
  // The first and last rows of the embedding and of one projection per layer: enough to
  // tell different checkpoints of one architecture apart, cheap for any model size.
  const size_t row = static_cast<size_t>(c.hidden_size) * DTypeSize(embed_.dtype);
  const auto* emb = static_cast<const uint8_t*>(embed_.w);
  mix(emb, row);
  mix(emb + (static_cast<size_t>(c.vocab_size) - 1) * row, row);
  for (const Layer& l : layers_) mix(l.q.w, static_cast<size_t>(l.q.in) * DTypeSize(l.q.dtype));
  mix(final_norm_.data(), final_norm_.size() * sizeof(float));
  fingerprint_ = absl::StrCat(c.model_type, "-", c.num_layers, "x", c.hidden_size, "-",
                              DTypeName(kv_dtype()), "-", absl::Hex(h, absl::kZeroPad16));
}

int64_t LlamaModel::WeightBytes() const {
  int64_t total = 0;
  auto add = [&](const Linear& l) { total += int64_t{l.out} * l.in * DTypeSize(l.dtype); };
  for (const Layer& l : layers_) {
    for (const Linear* x : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down}) add(*x);
  }
  add(lm_head_);
  return total;
}

absl::Status LlamaModel::MatMul(const Linear& l, const float* x, int m, float* y,
                                int64_t y_stride) {
  MatMulParams p;
  p.x = x;
  p.w = l.w;
  p.w_dtype = l.dtype;
  p.bias = l.bias;
  p.y = y;
  p.y_stride = y_stride;
  p.m = m;
  p.n = l.out;
  p.k = l.in;
  return backend_->MatMul(p);
}

void LlamaModel::EmbedRow(int32_t token, float* out) const {
  const size_t row = static_cast<size_t>(token) * config_.hidden_size * DTypeSize(embed_.dtype);
  ToFloat(embed_.dtype, static_cast<const uint8_t*>(embed_host_) + row, out, config_.hidden_size);
}

absl::StatusOr<std::unique_ptr<LlamaModel::Activations>> LlamaModel::MakeActivations(
    int rows, int chunk, int logit_rows, bool sampling) {
  const ModelConfig& c = config_;
  auto a = std::make_unique<Activations>();
  a->rows = rows;
  a->chunk = chunk;
  auto floats = [&](int64_t n) -> absl::StatusOr<float*> {
    auto buffer = AllocateOnBackend(static_cast<size_t>(n) * sizeof(float));
    if (!buffer.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("activations of ", rows, " rows: ", buffer.status().message()));
    }
    a->owned.push_back(std::move(*buffer));
    return static_cast<float*>(a->owned.back().get());
  };
  ASSIGN_OR_RETURN(a->x, floats(int64_t{rows} * c.hidden_size));
  ASSIGN_OR_RETURN(a->h, floats(int64_t{rows} * c.hidden_size));
  ASSIGN_OR_RETURN(a->qkv, floats(int64_t{rows} * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim));
  ASSIGN_OR_RETURN(a->attn, floats(int64_t{rows} * c.num_heads * c.head_dim));
  ASSIGN_OR_RETURN(a->gate_up, floats(int64_t{chunk} * 2 * c.intermediate_size));
  ASSIGN_OR_RETURN(a->act, floats(int64_t{chunk} * c.intermediate_size));
  ASSIGN_OR_RETURN(float* positions, floats(rows));  // int32 in a float's room
  a->positions = reinterpret_cast<int32_t*>(positions);
  if ((on_device() || sampling) && logit_rows > 0) {
    ASSIGN_OR_RETURN(a->logits, floats(int64_t{logit_rows} * c.vocab_size));
  }
  if (sampling) {
    static_assert(sizeof(kernels::SampledToken) == 2 * sizeof(float));
    ASSIGN_OR_RETURN(float* sampled, floats(2 * int64_t{rows}));  // {id, logprob} per row
    a->sampled = reinterpret_cast<kernels::SampledToken*>(sampled);
  }
  a->capacity = rows;
  if (on_device()) {
    a->positions_host.resize(rows);
    a->x_in = nullptr;  // the embedding rows are looked up on the device (EmbedOnDevice)
    a->positions_in = a->positions_host.data();
  } else {
    a->x_in = a->x;
    a->positions_in = a->positions;
  }
  return a;
}

absl::Status LlamaModel::CheckTokens(absl::Span<const int32_t> ids) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " at position ", i,
                                                     " is outside the vocabulary [0, ",
                                                     config_.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

// Attention's input: the Q, K and V projections of the normed rows in h (the first layer's
// norm, or the previous layer's fused into its residual add) into one [rows, q|k|v] buffer,
// and RoPE at each row's position.
absl::Status LlamaModel::AttentionIn(const Layer& L, Activations& a) {
  const ModelConfig& c = config_;
  const int d = c.head_dim, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t stride = qd + 2 * kvd;
  if (L.qkv.w != nullptr) {
    RETURN_IF_ERROR(MatMul(L.qkv, a.h, a.rows, a.qkv));
  } else {
    RETURN_IF_ERROR(MatMul(L.q, a.h, a.rows, a.qkv, stride));
    RETURN_IF_ERROR(MatMul(L.k, a.h, a.rows, a.qkv + qd, stride));
    RETURN_IF_ERROR(MatMul(L.v, a.h, a.rows, a.qkv + qd + kvd, stride));
  }
  RETURN_IF_ERROR(
      backend_->Rope({a.qkv, stride, a.positions, inv_freq_w_, a.rows, c.num_heads, d}));
  return backend_->Rope({a.qkv + qd, stride, a.positions, inv_freq_w_, a.rows, c.num_kv_heads, d});
}

// The first layer's norm of the embedded rows x into h; every later norm is fused into the
// residual add before it (AttentionOutAndMlp).
absl::Status LlamaModel::FirstNorm(Activations& a) {
  const ModelConfig& c = config_;
  return backend_->RmsNorm(
      {a.x, layers_[0].attn_norm_w, a.h, a.rows, c.hidden_size, c.rms_norm_eps});
}

// After attention: the output projection, its residual add fused into the MLP's norm, the
// SwiGLU MLP block, and its residual add fused into the next norm (the next layer's, or the
// final norm after the last), `chunk` rows at a time (bounds the [rows, 2·ffn] buffer). x is
// the residual stream; h leaves with the next norm's rows.
absl::Status LlamaModel::AttentionOutAndMlp(int li, Activations& a) {
  const ModelConfig& c = config_;
  const Layer& L = layers_[li];
  const float* next_norm_w = li + 1 < c.num_layers ? layers_[li + 1].attn_norm_w : final_norm_w_;
  const int hd = c.hidden_size, ffn = c.intermediate_size;
  RETURN_IF_ERROR(MatMul(L.o, a.attn, a.rows, a.h));
  for (int r0 = 0; r0 < a.rows; r0 += a.chunk) {
    const int rows = std::min(a.chunk, a.rows - r0);
    float* xr = a.x + int64_t{r0} * hd;
    float* hr = a.h + int64_t{r0} * hd;
    RmsNormParams norm{hr, L.mlp_norm_w, hr, rows, hd, c.rms_norm_eps};
    norm.residual = xr;
    RETURN_IF_ERROR(backend_->RmsNorm(norm));
    if (L.gate_up.w != nullptr) {
      RETURN_IF_ERROR(MatMul(L.gate_up, hr, rows, a.gate_up));
    } else {
      RETURN_IF_ERROR(MatMul(L.gate, hr, rows, a.gate_up, 2 * ffn));
      RETURN_IF_ERROR(MatMul(L.up, hr, rows, a.gate_up + ffn, 2 * ffn));
    }
    RETURN_IF_ERROR(backend_->SwiGlu({a.gate_up, a.act, rows, ffn}));
    RETURN_IF_ERROR(MatMul(L.down, a.act, rows, hr));
    norm.weight = next_norm_w;
    RETURN_IF_ERROR(backend_->RmsNorm(norm));
  }
  return absl::OkStatus();
}

// The LM head over rows [first, a.rows) of h (the final norm's, after the last layer), into
// host memory at `logits`.
absl::Status LlamaModel::Logits(Activations& a, int first, float* logits) {
  const ModelConfig& c = config_;
  const int rows = a.rows - first;
  const float* h = a.h + int64_t{first} * c.hidden_size;
  if (!on_device()) return MatMul(lm_head_, h, rows, logits);
  RETURN_IF_ERROR(MatMul(lm_head_, h, rows, a.logits));
  return backend_->CopyToHost(logits, a.logits,
                              static_cast<size_t>(rows) * c.vocab_size * sizeof(float));
}

// The inputs filled in on the host (positions) into the backend's memory.
absl::Status LlamaModel::UploadInputs(Activations& a) {
  if (!on_device()) return absl::OkStatus();  // written in place
  return backend_->CopyToDevice(a.positions, a.positions_host.data(),
                                static_cast<size_t>(a.rows) * sizeof(int32_t));
}

absl::Status LlamaModel::EmbedOnDevice(absl::Span<const int32_t> ids, float* out) {
  kernels::EmbedRowsParams p;
  p.table = embed_device_;
  p.dtype = embed_.dtype;
  p.vocab = config_.vocab_size;
  p.hidden = config_.hidden_size;
  p.ids = ids.data();
  p.n = static_cast<int>(ids.size());
  p.out = out;
  return backend_->EmbedRows(p);
}

kernels::PrefillAttentionParams LlamaModel::PrefillAttentionOver(const float* qkv, float* out,
                                                                 int len) const {
  const ModelConfig& c = config_;
  const int d = c.head_dim, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  kernels::PrefillAttentionParams ap;
  ap.q = qkv;
  ap.k = qkv + qd;
  ap.v = qkv + qd + kvd;
  ap.out = out;
  ap.q_stride = ap.kv_stride = qd + 2 * kvd;
  ap.out_stride = qd;
  ap.len = len;
  ap.n_heads = c.num_heads;
  ap.n_kv_heads = c.num_kv_heads;
  ap.head_dim = d;
  ap.scale = 1.f / std::sqrt(static_cast<float>(d));
  // A bf16 model's attention may run in bf16 (FlashInfer on a GPU); an f32 model's stays exact.
  ap.precision = weight_dtype_ == DType::kBF16 ? DType::kBF16 : DType::kF32;
  return ap;
}

absl::StatusOr<PrefillResult> LlamaModel::Prefill(absl::Span<const int32_t> ids,
                                                  PrefillObserver* observer, bool all_logits,
                                                  const PrefillPrefix* prefix) {
  const ModelConfig& c = config_;
  const int len = static_cast<int>(ids.size());
  if (len == 0) return absl::InvalidArgumentError("prefill needs at least one token");
  if (len > c.context_limit()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", len, " tokens exceeds the model's context of ", c.context_limit()));
  }
  RETURN_IF_ERROR(CheckTokens(ids));
  const int d = c.head_dim, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t stride = qd + 2 * kvd;
  const int window = observer ? std::min(observer->window(len), len) : 0;
  const int cached = prefix ? prefix->tokens() : 0;
  if (cached > 0) {
    if (all_logits || cached >= len || window > len - cached) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a cached prefix of ", cached, " tokens leaves ", len - cached, " of the prompt's ", len,
          " to compute; they must hold the observation window (", window,
          ") and the last token, without all_logits"));
    }
    for (const auto& block : prefix->blocks) {
      if (static_cast<int>(block.size()) != c.num_layers) {
        return absl::InvalidArgumentError("a cached prefix block must hold every layer");
      }
    }
  }
  const int first = all_logits ? 0 : len - 1;
  ASSIGN_OR_RETURN(std::unique_ptr<Activations> acts,
                   MakeActivations(len, std::min(len - cached, kMlpRowChunk), len - first, false));
  Activations& a = *acts;
  // The rows computed: all of them, or those after the prefix (a view into the same buffers).
  Activations tail;
  Activations& rows = cached > 0 ? tail : a;
  if (cached > 0) {
    tail.rows = tail.capacity = len - cached;
    tail.chunk = a.chunk;
    tail.x = a.x + int64_t{cached} * c.hidden_size;
    tail.h = a.h + int64_t{cached} * c.hidden_size;
    tail.qkv = a.qkv + cached * stride;
    tail.attn = a.attn + int64_t{cached} * qd;
    tail.gate_up = a.gate_up;
    tail.act = a.act;
    tail.logits = a.logits;
    tail.positions = a.positions + cached;
  }
  const size_t n_scores = static_cast<size_t>(c.num_heads) * window * len;
  BackendPtr scores_buffer;
  if (n_scores > 0) {
    ASSIGN_OR_RETURN(scores_buffer, AllocateOnBackend(n_scores * sizeof(float)));
  }
  float* scores = static_cast<float*>(scores_buffer.get());
  for (int i = cached; i < len; ++i) {
    a.positions_in[i] = i;
    if (!on_device()) EmbedRow(ids[i], a.x_in + int64_t{i} * c.hidden_size);
  }
  RETURN_IF_ERROR(UploadInputs(a));
  if (on_device()) {
    RETURN_IF_ERROR(EmbedOnDevice(ids.subspan(cached), a.x + int64_t{cached} * c.hidden_size));
  }
  RETURN_IF_ERROR(FirstNorm(rows));
  // Each cached block's rows go to the K and V columns of their rows of the qkv buffer.
  std::vector<kernels::ByteSpan> spans(cached > 0 ? prefix->block_tokens : 0);
  for (int li = 0; li < c.num_layers; ++li) {
    const Layer& L = layers_[li];
    RETURN_IF_ERROR(AttentionIn(L, rows));
    for (size_t b = 0; cached > 0 && b < prefix->blocks.size(); ++b) {
      for (int t = 0; t < prefix->block_tokens; ++t) {
        const int64_t row = static_cast<int64_t>(b) * prefix->block_tokens + t;
        spans[t] = {reinterpret_cast<const uint8_t*>(a.qkv + row * stride + qd),
                    static_cast<int64_t>(2 * kvd * sizeof(float))};
      }
      RETURN_IF_ERROR(backend_->PackSpans(
          {spans.data(), prefix->block_tokens,
           reinterpret_cast<uint8_t*>(const_cast<float*>(prefix->blocks[b][li])),
           /*unpack=*/true}));
    }
    PrefillAttentionParams ap = PrefillAttentionOver(a.qkv, a.attn, len);
    ap.q_begin = cached;
    ap.window = window > 0 && observer->NeedsScores(li, len) ? window : 0;
    ap.window_scores = ap.window > 0 ? scores : nullptr;
    RETURN_IF_ERROR(backend_->PrefillAttention(ap));
    if (observer) {
      // The layer as it is in backend memory: a compressor selects and gathers there, so a
      // GPU ships only the kept rows.
      PrefillLayer pl;
      pl.layer = li;
      pl.len = len;
      pl.backend = backend_.get();
      pl.k = a.qkv + qd;
      pl.v = a.qkv + qd + kvd;
      pl.kv_stride = stride;
      pl.window_scores = ap.window > 0 ? scores : nullptr;
      pl.window = ap.window;
      RETURN_IF_ERROR(observer->OnLayer(pl));
    }
    RETURN_IF_ERROR(AttentionOutAndMlp(li, rows));
  }
  if (observer) RETURN_IF_ERROR(observer->Finish());
  PrefillResult result;
  result.logits.resize(int64_t{len - first} * c.vocab_size);
  RETURN_IF_ERROR(Logits(rows, first - cached, result.logits.data()));
  return result;
}

absl::Status LlamaModel::CheckDecodeBatch(absl::Span<const DecodeInput> batch) const {
  const ModelConfig& c = config_;
  for (const DecodeInput& in : batch) {
    if (in.cache == nullptr) return absl::InvalidArgumentError("decode input without a cache");
    if (in.token < 0 || in.token >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token id ", in.token, " is outside the vocabulary [0, ", c.vocab_size, ")"));
    }
    if (in.position < 0 || in.position >= c.context_limit()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "position ", in.position, " is outside the model's context of ", c.context_limit()));
    }
    if (!on_device() && !in.cache->host_rows()) {
      return absl::FailedPreconditionError(
          "this KV cache's rows are in a device's memory (a KV pool on a device backend); "
          "decode it with a model on that backend");
    }
    const KvCacheShape& s = in.cache->shape();
    if (in.cache->num_layers() != c.num_layers || s.head_dim != c.head_dim ||
        (s.n_heads != c.num_kv_heads && s.n_heads != c.num_heads)) {
      return absl::InvalidArgumentError("KV cache shape does not match the model");
    }
    for (int li = 0; li < c.num_layers; ++li) {
      const LayerCache& lc = in.cache->layer(li);
      if (lc.len >= lc.capacity) {
        return absl::FailedPreconditionError(
            absl::StrCat("KV cache of layer ", li, " is full (", lc.capacity, " tokens)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LlamaModel::DecodeStep(absl::Span<const DecodeInput> batch, float* logits,
                                    DecodeObserver* observer, DecodeTimes* times) {
  if (batch.empty()) return absl::OkStatus();
  if (on_device() && observer != nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "decode attention probabilities (a DecodeObserver) are measured on the cpu and "
        "reference backends; on ",
        kernels::BackendName(backend_->kind()), " this version does not return them"));
  }
  std::lock_guard<std::mutex> lock(decode_mu_);
  ASSIGN_OR_RETURN(Activations * a, DecodeActivations(batch));
  const ModelConfig& c = config_;
  const int bsz = static_cast<int>(batch.size());
  RETURN_IF_ERROR(RunDecodeOps(batch, times == nullptr && observer == nullptr, [&] {
    RETURN_IF_ERROR(DecodeLayers(batch, *a, observer, times));
    return MatMul(lm_head_, a->h, bsz, on_device() ? a->logits : logits);
  }));
  if (!on_device()) return absl::OkStatus();
  return backend_->CopyToHost(logits, a->logits,
                              static_cast<size_t>(bsz) * c.vocab_size * sizeof(float));
}

absl::Status LlamaModel::DecodeStepSampled(absl::Span<const DecodeInput> batch,
                                           absl::Span<const kernels::SampleRow> rows,
                                           kernels::SampledToken* out, DecodeTimes* times) {
  if (batch.empty()) return absl::OkStatus();
  if (rows.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a sampled decode step of ", batch.size(),
                                                   " sequences got ", rows.size(),
                                                   " rows of sampling parameters"));
  }
  std::lock_guard<std::mutex> lock(decode_mu_);
  ASSIGN_OR_RETURN(Activations * a, DecodeActivations(batch));
  const ModelConfig& c = config_;
  const int bsz = static_cast<int>(batch.size());
  RETURN_IF_ERROR(RunDecodeOps(batch, times == nullptr, [&] {
    RETURN_IF_ERROR(DecodeLayers(batch, *a, nullptr, times));
    RETURN_IF_ERROR(MatMul(lm_head_, a->h, bsz, a->logits));
    kernels::SampleParams sp;
    sp.logits = a->logits;
    sp.batch = bsz;
    sp.vocab = c.vocab_size;
    sp.rows = rows.data();
    sp.out = a->sampled;
    return backend_->Sample(sp);
  }));
  // The step's one copy to the host: each sequence's token and its log-probability.
  return backend_->CopyToHost(out, a->sampled, sizeof(kernels::SampledToken) * bsz);
}

void LlamaModel::SetDecodeGraphs(bool on) {
  std::lock_guard<std::mutex> lock(decode_mu_);
  options_.decode_graphs = on;
}

bool LlamaModel::decode_graphs() const {
  std::lock_guard<std::mutex> lock(decode_mu_);
  return GraphsOn();
}

bool LlamaModel::GraphsOn() const {
  return on_device() && options_.decode_graphs && backend_->SupportsGraphs() &&
         graph_failures_ < kGraphFailuresToStop;
}

// A decode step's ops (`ops`, up to the step's copy to the host) as one graph where they can
// be (`graph`, the step's own condition, on a backend that records graphs), else as they are
// called. A graph that fails does so before any of its work ran: the caches' lengths are put
// back, the selectors told (StepUndone), and the step runs again op by op. Where that succeeds
// the graph was at fault (another thread's device-wide wait can void a recording, say); after
// kGraphFailuresToStop such steps in a row the model's steps stay op by op (said on stderr).
// Called with decode_mu_ held.
absl::Status LlamaModel::RunDecodeOps(absl::Span<const DecodeInput> batch, bool graph,
                                      const std::function<absl::Status()>& ops) {
  if (!graph || !GraphsOn()) return ops();
  std::vector<int> lens;
  for (const DecodeInput& in : batch) {
    for (int li = 0; li < in.cache->num_layers(); ++li) lens.push_back(in.cache->layer(li).len);
  }
  absl::Status st = backend_->BeginGraph(static_cast<int64_t>(batch.size()));
  if (st.ok()) {
    st = ops();
    if (st.ok()) {
      st = backend_->EndGraph();
    } else {
      backend_->AbortGraph();
    }
  }
  if (st.ok()) {
    graph_failures_ = 0;
    return st;
  }
  size_t i = 0;
  for (const DecodeInput& in : batch) {
    for (int li = 0; li < in.cache->num_layers(); ++li) in.cache->layer(li).len = lens[i++];
    if (in.selector != nullptr) in.selector->StepUndone();
  }
  RETURN_IF_ERROR(ops());
  ++graph_failures_;
  std::fprintf(stderr, "kvwire: a decode step's graph failed (%d in a row), run op by op%s: %s\n",
               graph_failures_,
               graph_failures_ < kGraphFailuresToStop ? "" : "; decode stays op by op",
               st.ToString().c_str());
  return absl::OkStatus();
}

// The decode activations for `batch` (checked): reused while the batch fits (requests join and
// leave between steps), regrown to the largest batch seen. Called with decode_mu_ held.
absl::StatusOr<LlamaModel::Activations*> LlamaModel::DecodeActivations(
    absl::Span<const DecodeInput> batch) {
  const int bsz = static_cast<int>(batch.size());
  RETURN_IF_ERROR(CheckDecodeBatch(batch));
  if (decode_activations_ == nullptr || decode_activations_->capacity < bsz) {
    decode_activations_.reset();
    ASSIGN_OR_RETURN(decode_activations_, MakeActivations(bsz, bsz, bsz, true));
  }
  Activations& a = *decode_activations_;
  a.rows = a.chunk = bsz;
  return &a;
}

// The layers of a decode step, leaving each sequence's last hidden state in a.x and its final
// norm in a.h. Called with decode_mu_ held.
absl::Status LlamaModel::DecodeLayers(absl::Span<const DecodeInput> batch, Activations& a,
                                      DecodeObserver* observer, DecodeTimes* times) {
  const int bsz = static_cast<int>(batch.size());
  for (int b = 0; b < bsz; ++b) {
    a.positions_in[b] = batch[b].position;
    if (!on_device()) EmbedRow(batch[b].token, a.x_in + int64_t{b} * config_.hidden_size);
  }
  RETURN_IF_ERROR(UploadInputs(a));
  if (on_device()) {
    std::vector<int32_t> tokens(bsz);
    for (int b = 0; b < bsz; ++b) tokens[b] = batch[b].token;
    RETURN_IF_ERROR(EmbedOnDevice(tokens, a.x));
    RETURN_IF_ERROR(SyncDeviceCaches(batch));
  }
  RETURN_IF_ERROR(FirstNorm(a));
  for (int li = 0; li < config_.num_layers; ++li) {
    RETURN_IF_ERROR(AttentionIn(layers_[li], a));
    if (on_device()) {
      RETURN_IF_ERROR(DecodeAttentionLayerOnDevice(li, batch, a, times));
    } else {
      RETURN_IF_ERROR(DecodeAttentionLayer(li, batch, a, observer, times));
    }
    RETURN_IF_ERROR(AttentionOutAndMlp(li, a));
  }
  return absl::OkStatus();
}

}  // namespace kvwire
