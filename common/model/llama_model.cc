#include "common/model/llama_model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
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

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// SplitMix64: a tiny, good-enough generator for synthetic weights, seekable by index so
// that any slice of a tensor can be filled independently and deterministically.
uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float UniformAt(uint64_t seed, uint64_t i) {
  return static_cast<float>(SplitMix(seed ^ (i * 0x2545f4914f6cdd1dull)) >> 40) * 0x1.0p-24f * 2.f -
         1.f;
}

struct SyntheticPreset {
  const char* name;
  const char* help;
  int layers, hidden, heads, kv_heads, head_dim, ffn, vocab, context;
  DType dtype;
  double theta;
};

// Shapes of real models, for benchmarks at sizes no model in ../shared has.
constexpr SyntheticPreset kPresets[] = {
    {"tiny", "2 layers, hidden 64: for tests", 2, 64, 4, 2, 16, 128, 320, 4096, DType::kF32, 1e4},
    {"stories", "the shape of stories260K (5 layers, hidden 64)", 5, 64, 8, 4, 8, 172, 512, 512,
     DType::kF32, 1e4},
    {"llama-1b", "Llama-3.2-1B shape: 16 layers, hidden 2048, 32 heads, 8 KV heads, bf16", 16, 2048,
     32, 8, 64, 8192, 32000, 131072, DType::kBF16, 5e5},
    {"attn-8kv",
     "attention-bound: 2 layers, hidden 1024, 32 heads, 8 KV heads x 128, bf16, 32K context", 2,
     1024, 32, 8, 128, 1024, 1024, 32768, DType::kBF16, 5e5},
};

}  // namespace

LlamaModel::~LlamaModel() = default;

std::string LlamaModel::SyntheticSpecHelp() {
  std::string s = "synthetic:NAME[,key=value...] with NAME one of:\n";
  for (const auto& p : kPresets) absl::StrAppend(&s, "  ", p.name, ": ", p.help, "\n");
  absl::StrAppend(&s,
                  "keys: layers, hidden, heads, kv_heads, head_dim, ffn, vocab, context, "
                  "dtype (f32|bf16|f16), theta, seed");
  return s;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& spec,
                                                             const LoadOptions& options) {
  std::unique_ptr<LlamaModel> model(new LlamaModel());
  ASSIGN_OR_RETURN(model->backend_, kernels::MakeBackend(options.backend, options.threads));
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
  // backend's buffers, which are on huge pages (host_alloc.h). Decode at batch 1 streams every
  // weight once a token; on the development machine a 2-thread read of 1 GiB ran 5-7% faster
  // from huge pages than from the file's mapping, and the 1B model's decode faster in 9 of 11
  // alternated pairs (docs/benchmarks.md, "Weights on huge pages"). The cost is the copy at
  // load, and the memory: anonymous, where a mapping's pages are the page cache's.
  // Each host array once (the LM head may be the embedding).
  std::map<const void*, const void*> placed;
  const int64_t total = WeightBytes();
  auto upload = [&](const void* host, size_t bytes) -> absl::StatusOr<const void*> {
    if (auto it = placed.find(host); it != placed.end()) return it->second;
    auto buffer = AllocateOnBackend(bytes);
    if (!buffer.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the model's ", total >> 20, " MiB of weights do not fit in ",
          kernels::BackendName(backend_->kind()), " backend memory: ", buffer.status().message()));
    }
    RETURN_IF_ERROR(backend_->CopyToDevice(buffer->get(), host, bytes));
    placed[host] = buffer->get();
    placed_.push_back(std::move(*buffer));
    return placed_.back().get();
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
  for (Layer& l : layers_) {
    for (Linear* x : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down}) {
      RETURN_IF_ERROR(place_linear(*x));
    }
    ASSIGN_OR_RETURN(l.attn_norm_w, place_floats(l.attn_norm));
    ASSIGN_OR_RETURN(l.mlp_norm_w, place_floats(l.mlp_norm));
  }
  RETURN_IF_ERROR(place_linear(lm_head_));
  ASSIGN_OR_RETURN(final_norm_w_, place_floats(final_norm_));
  ASSIGN_OR_RETURN(inv_freq_w_, place_floats(inv_freq_));
  // The embedding stays on the host (EmbedRow reads one row a token); embed_.w now names the
  // device copy where it is also the LM head.
  if (auto it = placed.find(embed_.w); it != placed.end()) embed_.w = it->second;
  // The host copies of the projections are no longer read: the synthetic ones are freed (a
  // mapped file's pages are the page cache's).
  for (auto it = owned_.begin(); it != owned_.end();) {
    it = it->data() == embed_host_ ? std::next(it) : owned_.erase(it);
  }
  return backend_->Synchronize();
}

absl::StatusOr<const float*> LlamaModel::HostView(const float* p, size_t n,
                                                  std::vector<float>* staging) {
  if (!on_device()) return p;
  staging->resize(n);
  RETURN_IF_ERROR(backend_->CopyToHost(staging->data(), p, n * sizeof(float)));
  return staging->data();
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

const void* LlamaModel::Own(std::vector<uint8_t> bytes) {
  owned_.push_back(std::move(bytes));
  return owned_.back().data();
}

const float* LlamaModel::OwnFloats(std::vector<float> values) {
  owned_floats_.push_back(std::move(values));
  return owned_floats_.back().data();
}

absl::StatusOr<LlamaModel::Linear> LlamaModel::LoadLinear(const std::string& name, int out, int in,
                                                          bool bias) {
  ASSIGN_OR_RETURN(const TensorView* t, files_->Get(name + ".weight"));
  if (t->shape != std::vector<int64_t>{out, in}) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".weight: shape ", ShapeString(t->shape),
        " disagrees with config.json, which implies [", out, ", ", in,
        "] (hidden_size=", config_.hidden_size, ", num_attention_heads=", config_.num_heads,
        ", num_key_value_heads=", config_.num_kv_heads, ", head_dim=", config_.head_dim,
        ", intermediate_size=", config_.intermediate_size, ")"));
  }
  auto dt = ParseDType(t->dtype);
  if (!dt.ok()) return Annotate(dt.status(), name + ".weight");
  Linear l;
  l.out = out;
  l.in = in;
  l.dtype = weight_dtype_;
  const size_t n = static_cast<size_t>(out) * in;
  const bool aligned = reinterpret_cast<uintptr_t>(t->data) % DTypeSize(*dt) == 0;
  if (*dt == weight_dtype_ && aligned) {
    l.w = t->data;  // used in place from the mapping
  } else {
    std::vector<float> wide(n);
    if (aligned) {
      ToFloat(*dt, t->data, wide.data(), n);
    } else {
      std::vector<uint8_t> copy(t->data, t->data + t->bytes);
      ToFloat(*dt, copy.data(), wide.data(), n);
    }
    std::vector<uint8_t> stored(n * DTypeSize(weight_dtype_));
    FromFloat(weight_dtype_, wide.data(), stored.data(), n);
    l.w = Own(std::move(stored));
  }
  if (bias) {
    ASSIGN_OR_RETURN(std::vector<float> b, LoadVector(name + ".bias", out));
    l.bias = OwnFloats(std::move(b));
  }
  return l;
}

absl::StatusOr<std::vector<float>> LlamaModel::LoadVector(const std::string& name, int n) {
  ASSIGN_OR_RETURN(const TensorView* t, files_->Get(name));
  if (t->shape != std::vector<int64_t>{n}) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", ShapeString(t->shape),
                                                   " disagrees with config.json, which implies [",
                                                   n, "]"));
  }
  auto dt = ParseDType(t->dtype);
  if (!dt.ok()) return Annotate(dt.status(), name);
  std::vector<uint8_t> copy(t->data, t->data + t->bytes);  // may be unaligned in the file
  std::vector<float> v(n);
  ToFloat(*dt, copy.data(), v.data(), n);
  return v;
}

absl::Status LlamaModel::LoadFromFolder(const std::string& dir, const LoadOptions& options) {
  ASSIGN_OR_RETURN(config_, ModelConfig::FromFile(dir + "/config.json"));
  ASSIGN_OR_RETURN(tokenizer_, Tokenizer::FromFile(dir + "/tokenizer.json"));
  if (!config_.eos_token_ids.empty()) tokenizer_->set_eos_id(config_.eos_token_ids.front());
  ASSIGN_OR_RETURN(files_, WeightFiles::OpenDirectory(dir));
  const ModelConfig& c = config_;

  ASSIGN_OR_RETURN(const TensorView* emb, files_->Get("model.embed_tokens.weight"));
  ASSIGN_OR_RETURN(DType stored, ParseDType(emb->dtype));
  weight_dtype_ = options.weight_dtype.value_or(stored);

  ASSIGN_OR_RETURN(embed_, LoadLinear("model.embed_tokens", c.vocab_size, c.hidden_size, false));
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    ASSIGN_OR_RETURN(lm_head_, LoadLinear("lm_head", c.vocab_size, c.hidden_size, false));
  }
  ASSIGN_OR_RETURN(final_norm_, LoadVector("model.norm.weight", c.hidden_size));
  const int qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer l;
    ASSIGN_OR_RETURN(l.attn_norm, LoadVector(p + "input_layernorm.weight", c.hidden_size));
    ASSIGN_OR_RETURN(l.mlp_norm, LoadVector(p + "post_attention_layernorm.weight", c.hidden_size));
    ASSIGN_OR_RETURN(l.q, LoadLinear(p + "self_attn.q_proj", qd, c.hidden_size, c.qkv_bias));
    ASSIGN_OR_RETURN(l.k, LoadLinear(p + "self_attn.k_proj", kvd, c.hidden_size, c.qkv_bias));
    ASSIGN_OR_RETURN(l.v, LoadLinear(p + "self_attn.v_proj", kvd, c.hidden_size, c.qkv_bias));
    ASSIGN_OR_RETURN(l.o, LoadLinear(p + "self_attn.o_proj", c.hidden_size, qd, c.o_bias));
    ASSIGN_OR_RETURN(
        l.gate, LoadLinear(p + "mlp.gate_proj", c.intermediate_size, c.hidden_size, c.mlp_bias));
    ASSIGN_OR_RETURN(l.up,
                     LoadLinear(p + "mlp.up_proj", c.intermediate_size, c.hidden_size, c.mlp_bias));
    ASSIGN_OR_RETURN(
        l.down, LoadLinear(p + "mlp.down_proj", c.hidden_size, c.intermediate_size, c.mlp_bias));
    layers_.push_back(std::move(l));
  }
  std::string name = dir;
  while (name.size() > 1 && name.back() == '/') name.pop_back();
  name = name.substr(name.find_last_of('/') + 1);
  description_ =
      absl::StrCat(name, " (", c.architecture.empty() ? c.model_type : c.architecture, ", ",
                   DTypeName(weight_dtype_), " weights from ", files_->Describe(), ")");
  return absl::OkStatus();
}

namespace {

// "synthetic:NAME[,key=value...]": a preset's shape with the overrides applied, and the seed.
absl::StatusOr<std::pair<ModelConfig, uint64_t>> ParseSyntheticSpec(const std::string& spec) {
  const std::string body = spec.substr(std::string("synthetic:").size());
  std::vector<std::string> parts = absl::StrSplit(body, ',');
  const SyntheticPreset* preset = nullptr;
  for (const auto& p : kPresets) {
    if (parts[0] == p.name) preset = &p;
  }
  if (preset == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown synthetic model '", parts[0], "'; ",
                                                   LlamaModel::SyntheticSpecHelp()));
  }
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.model_type = "llama";
  c.num_layers = preset->layers;
  c.hidden_size = preset->hidden;
  c.num_heads = preset->heads;
  c.num_kv_heads = preset->kv_heads;
  c.head_dim = preset->head_dim;
  c.intermediate_size = preset->ffn;
  c.vocab_size = preset->vocab;
  c.max_position_embeddings = preset->context;
  c.rope_theta = preset->theta;
  c.dtype = preset->dtype;
  c.tie_word_embeddings = true;
  // The overrides: integer shape fields, then theta, dtype and the seed.
  static constexpr std::pair<const char*, int ModelConfig::*> kIntKeys[] = {
      {"layers", &ModelConfig::num_layers}, {"hidden", &ModelConfig::hidden_size},
      {"heads", &ModelConfig::num_heads},   {"kv_heads", &ModelConfig::num_kv_heads},
      {"head_dim", &ModelConfig::head_dim}, {"ffn", &ModelConfig::intermediate_size},
      {"vocab", &ModelConfig::vocab_size},  {"context", &ModelConfig::max_position_embeddings}};
  uint64_t seed = 1234;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::pair<std::string, std::string> kv =
        absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    const std::string& key = kv.first;
    const std::string& value = kv.second;
    int iv = 0;
    const bool positive = absl::SimpleAtoi(value, &iv) && iv > 0;
    const auto field = std::find_if(std::begin(kIntKeys), std::end(kIntKeys),
                                    [&](const auto& k) { return key == k.first; });
    if (field != std::end(kIntKeys) || key == "seed") {
      if (!positive) {
        return absl::InvalidArgumentError(absl::StrCat(
            "synthetic model: ", key, " must be a positive integer, got '", value, "'"));
      }
      if (key == "seed") {
        seed = static_cast<uint64_t>(iv);
      } else {
        c.*(field->second) = iv;
      }
    } else if (key == "theta") {
      double t = 0;
      if (!absl::SimpleAtod(value, &t) || !(t > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("synthetic model: theta must be > 0, got '", value, "'"));
      }
      c.rope_theta = t;
    } else if (key == "dtype") {
      ASSIGN_OR_RETURN(c.dtype, ParseDType(value));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("synthetic model: unknown key '", key, "'; ",
                                                     LlamaModel::SyntheticSpecHelp()));
    }
  }
  if (c.vocab_size < 259) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic model: vocab must be >= 259 for the byte tokenizer, got ", c.vocab_size));
  }
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  RETURN_IF_ERROR(c.Validate("synthetic model"));
  return std::make_pair(c, seed);
}

}  // namespace

// Deterministic random weights of the spec's shape: uniform with variance 1/in per linear
// (activations keep their scale through the layers), norms of ones, tied embeddings.
absl::Status LlamaModel::LoadSynthetic(const std::string& spec, const LoadOptions& options) {
  ASSIGN_OR_RETURN(auto parsed, ParseSyntheticSpec(spec));
  config_ = parsed.first;
  const uint64_t seed = parsed.second;
  const ModelConfig& c = config_;
  tokenizer_ = Tokenizer::Bytes(c.vocab_size);
  weight_dtype_ = options.weight_dtype.value_or(c.dtype);

  uint64_t tensor_index = 0;
  auto random_linear = [&](int out, int in) {
    // Uniform with variance 1/in, so activations keep their scale through the layers.
    const float a = std::sqrt(3.f / in);
    const uint64_t s = SplitMix(seed + 0x51ed27ull * ++tensor_index);
    const size_t n = static_cast<size_t>(out) * in;
    std::vector<uint8_t> bytes(n * DTypeSize(weight_dtype_));
    std::vector<float> row(in);
    for (int r = 0; r < out; ++r) {
      for (int i = 0; i < in; ++i) row[i] = a * UniformAt(s, static_cast<uint64_t>(r) * in + i);
      FromFloat(weight_dtype_, row.data(),
                bytes.data() + static_cast<size_t>(r) * in * DTypeSize(weight_dtype_), in);
    }
    Linear l;
    l.out = out;
    l.in = in;
    l.dtype = weight_dtype_;
    l.w = Own(std::move(bytes));
    return l;
  };
  const int qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  embed_ = random_linear(c.vocab_size, c.hidden_size);
  lm_head_ = embed_;
  final_norm_.assign(c.hidden_size, 1.f);
  for (int i = 0; i < c.num_layers; ++i) {
    Layer l;
    l.attn_norm.assign(c.hidden_size, 1.f);
    l.mlp_norm.assign(c.hidden_size, 1.f);
    l.q = random_linear(qd, c.hidden_size);
    l.k = random_linear(kvd, c.hidden_size);
    l.v = random_linear(kvd, c.hidden_size);
    l.o = random_linear(c.hidden_size, qd);
    l.gate = random_linear(c.intermediate_size, c.hidden_size);
    l.up = random_linear(c.intermediate_size, c.hidden_size);
    l.down = random_linear(c.hidden_size, c.intermediate_size);
    layers_.push_back(std::move(l));
  }
  description_ = absl::StrCat(spec, " (synthetic ", c.num_layers, " layers, hidden ", c.hidden_size,
                              ", ", c.num_heads, "/", c.num_kv_heads, " heads x ", c.head_dim, ", ",
                              DTypeName(weight_dtype_), " weights, ", c.ParameterCount() / 1000000,
                              "M parameters)");
  return absl::OkStatus();
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

// Scratch of one forward pass over `rows` token rows, in the backend's memory; the MLP runs
// `chunk` rows at a time. `logits` holds logit_rows rows of logits on a GPU (on a host backend
// they are written to the caller's array directly).
struct LlamaModel::Activations {
  int rows = 0, chunk = 0;
  int capacity = 0;  // rows allocated (a decode step's are reused for smaller batches)
  float *x = nullptr, *h = nullptr, *qkv = nullptr, *attn = nullptr, *gate_up = nullptr,
        *act = nullptr, *logits = nullptr;
  int32_t* positions = nullptr;
  // Where the inputs (token embeddings, positions) are written on the host: x and positions
  // themselves on a host backend, else these arrays, which UploadInputs copies to the device.
  std::vector<float> x_host;
  std::vector<int32_t> positions_host;
  float* x_in = nullptr;
  int32_t* positions_in = nullptr;
  std::vector<BackendPtr> owned;
};

absl::StatusOr<std::unique_ptr<LlamaModel::Activations>> LlamaModel::MakeActivations(
    int rows, int chunk, int logit_rows) {
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
  if (on_device() && logit_rows > 0) {
    ASSIGN_OR_RETURN(a->logits, floats(int64_t{logit_rows} * c.vocab_size));
  }
  a->capacity = rows;
  if (on_device()) {
    a->x_host.resize(int64_t{rows} * c.hidden_size);
    a->positions_host.resize(rows);
    a->x_in = a->x_host.data();
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

// Attention's input: RMSNorm, the Q, K and V projections into one [rows, q|k|v] buffer, and
// RoPE at each row's position.
absl::Status LlamaModel::AttentionIn(const Layer& L, Activations& a) {
  const ModelConfig& c = config_;
  const int d = c.head_dim, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t stride = qd + 2 * kvd;
  RETURN_IF_ERROR(
      backend_->RmsNorm({a.x, L.attn_norm_w, a.h, a.rows, c.hidden_size, c.rms_norm_eps}));
  RETURN_IF_ERROR(MatMul(L.q, a.h, a.rows, a.qkv, stride));
  RETURN_IF_ERROR(MatMul(L.k, a.h, a.rows, a.qkv + qd, stride));
  RETURN_IF_ERROR(MatMul(L.v, a.h, a.rows, a.qkv + qd + kvd, stride));
  RETURN_IF_ERROR(
      backend_->Rope({a.qkv, stride, a.positions, inv_freq_w_, a.rows, c.num_heads, d}));
  return backend_->Rope({a.qkv + qd, stride, a.positions, inv_freq_w_, a.rows, c.num_kv_heads, d});
}

// After attention: the output projection and the residual, then the SwiGLU MLP block and
// its residual, `chunk` rows at a time (bounds the [rows, 2·ffn] buffer).
absl::Status LlamaModel::AttentionOutAndMlp(const Layer& L, Activations& a) {
  const ModelConfig& c = config_;
  const int hd = c.hidden_size, ffn = c.intermediate_size;
  RETURN_IF_ERROR(MatMul(L.o, a.attn, a.rows, a.h));
  RETURN_IF_ERROR(backend_->Add({a.h, a.x, int64_t{a.rows} * hd}));
  for (int r0 = 0; r0 < a.rows; r0 += a.chunk) {
    const int rows = std::min(a.chunk, a.rows - r0);
    float* xr = a.x + int64_t{r0} * hd;
    float* hr = a.h + int64_t{r0} * hd;
    RETURN_IF_ERROR(backend_->RmsNorm({xr, L.mlp_norm_w, hr, rows, hd, c.rms_norm_eps}));
    RETURN_IF_ERROR(MatMul(L.gate, hr, rows, a.gate_up, 2 * ffn));
    RETURN_IF_ERROR(MatMul(L.up, hr, rows, a.gate_up + ffn, 2 * ffn));
    RETURN_IF_ERROR(backend_->SwiGlu({a.gate_up, a.act, rows, ffn}));
    RETURN_IF_ERROR(MatMul(L.down, a.act, rows, hr));
    RETURN_IF_ERROR(backend_->Add({hr, xr, int64_t{rows} * hd}));
  }
  return absl::OkStatus();
}

// The final norm and the LM head over rows [first, a.rows), into host memory at `logits`.
absl::Status LlamaModel::Logits(Activations& a, int first, float* logits) {
  const ModelConfig& c = config_;
  const int rows = a.rows - first;
  RETURN_IF_ERROR(backend_->RmsNorm({a.x + int64_t{first} * c.hidden_size, final_norm_w_, a.h, rows,
                                     c.hidden_size, c.rms_norm_eps}));
  if (!on_device()) return MatMul(lm_head_, a.h, rows, logits);
  RETURN_IF_ERROR(MatMul(lm_head_, a.h, rows, a.logits));
  return backend_->CopyToHost(logits, a.logits,
                              static_cast<size_t>(rows) * c.vocab_size * sizeof(float));
}

// The inputs filled in on the host (embeddings, positions) into the backend's memory.
absl::Status LlamaModel::UploadInputs(Activations& a) {
  if (!on_device()) return absl::OkStatus();  // written in place
  RETURN_IF_ERROR(backend_->CopyToDevice(
      a.x, a.x_host.data(), static_cast<size_t>(a.rows) * config_.hidden_size * sizeof(float)));
  return backend_->CopyToDevice(a.positions, a.positions_host.data(),
                                static_cast<size_t>(a.rows) * sizeof(int32_t));
}

absl::StatusOr<PrefillResult> LlamaModel::Prefill(absl::Span<const int32_t> ids,
                                                  PrefillObserver* observer, bool all_logits) {
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
  const int first = all_logits ? 0 : len - 1;
  ASSIGN_OR_RETURN(std::unique_ptr<Activations> acts,
                   MakeActivations(len, std::min(len, kMlpRowChunk), len - first));
  Activations& a = *acts;
  const size_t n_scores = static_cast<size_t>(c.num_heads) * window * len;
  BackendPtr scores_buffer;
  if (n_scores > 0) {
    ASSIGN_OR_RETURN(scores_buffer, AllocateOnBackend(n_scores * sizeof(float)));
  }
  float* scores = static_cast<float*>(scores_buffer.get());
  for (int i = 0; i < len; ++i) {
    a.positions_in[i] = i;
    EmbedRow(ids[i], a.x_in + int64_t{i} * c.hidden_size);
  }
  RETURN_IF_ERROR(UploadInputs(a));
  std::vector<float> qkv_host, scores_host;  // what the observer reads, on a GPU
  for (int li = 0; li < c.num_layers; ++li) {
    const Layer& L = layers_[li];
    RETURN_IF_ERROR(AttentionIn(L, a));
    PrefillAttentionParams ap;
    ap.q = a.qkv;
    ap.k = a.qkv + qd;
    ap.v = a.qkv + qd + kvd;
    ap.out = a.attn;
    ap.q_stride = ap.kv_stride = stride;
    ap.out_stride = qd;
    ap.len = len;
    ap.n_heads = c.num_heads;
    ap.n_kv_heads = c.num_kv_heads;
    ap.head_dim = d;
    ap.scale = 1.f / std::sqrt(static_cast<float>(d));
    ap.window = window > 0 && observer->NeedsScores(li, len) ? window : 0;
    ap.window_scores = ap.window > 0 ? scores : nullptr;
    RETURN_IF_ERROR(backend_->PrefillAttention(ap));
    if (observer) {
      // On a GPU the observer reads host copies of the layer's K/V and scores (the compressor
      // runs on the host).
      ASSIGN_OR_RETURN(const float* qkv,
                       HostView(a.qkv, static_cast<size_t>(len) * stride, &qkv_host));
      PrefillLayer pl;
      pl.layer = li;
      pl.len = len;
      pl.k = qkv + qd;
      pl.v = qkv + qd + kvd;
      pl.kv_stride = stride;
      if (ap.window > 0) {
        ASSIGN_OR_RETURN(pl.window_scores, HostView(scores, n_scores, &scores_host));
      }
      pl.window = ap.window;
      RETURN_IF_ERROR(observer->OnLayer(pl));
    }
    RETURN_IF_ERROR(AttentionOutAndMlp(L, a));
  }
  PrefillResult result;
  result.logits.resize(int64_t{len - first} * c.vocab_size);
  RETURN_IF_ERROR(Logits(a, first, result.logits.data()));
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
    if (!on_device() && in.cache->attachment() != nullptr) {
      return absl::FailedPreconditionError(
          "this KV cache was decoded on a device (its generated rows are in the device copy); "
          "decode it with the model it was decoded by");
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

absl::StatusOr<bool> DecodeSelector::Select(int layer, const float* q, const LayerCache& cache,
                                            std::vector<int32_t>* indices, int* num_indices) {
  ASSIGN_OR_RETURN(const bool sparse, Plan(layer, cache, num_indices));
  if (!sparse) {
    Done(layer, q, cache, nullptr, 0);
    return false;
  }
  indices->resize(static_cast<size_t>(cache.n_heads) * *num_indices);
  for (int c = 0; c < cache.n_heads; ++c) {
    SelectHead(layer, q, cache, c, indices->data() + static_cast<size_t>(c) * *num_indices);
  }
  Done(layer, q, cache, indices->data(), *num_indices);
  return true;
}

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

absl::Status LlamaModel::DecodeStep(absl::Span<const DecodeInput> batch, float* logits,
                                    DecodeObserver* observer, DecodeTimes* times) {
  const int bsz = static_cast<int>(batch.size());
  if (bsz == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckDecodeBatch(batch));
  if (on_device()) {
    if (observer != nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          "decode attention probabilities (a DecodeObserver) are measured on the cpu and "
          "reference backends; on ",
          kernels::BackendName(backend_->kind()), " this version does not return them"));
    }
  }
  std::lock_guard<std::mutex> lock(decode_mu_);
  // Reused while the batch fits (requests join and leave between steps); regrown to the
  // largest batch seen.
  if (decode_activations_ == nullptr || decode_activations_->capacity < bsz) {
    decode_activations_.reset();
    ASSIGN_OR_RETURN(decode_activations_, MakeActivations(bsz, bsz, bsz));
  }
  Activations& a = *decode_activations_;
  a.rows = a.chunk = bsz;
  for (int b = 0; b < bsz; ++b) {
    a.positions_in[b] = batch[b].position;
    EmbedRow(batch[b].token, a.x_in + int64_t{b} * config_.hidden_size);
  }
  RETURN_IF_ERROR(UploadInputs(a));
  if (on_device()) RETURN_IF_ERROR(SyncDeviceCaches(batch));
  for (int li = 0; li < config_.num_layers; ++li) {
    const Layer& L = layers_[li];
    RETURN_IF_ERROR(AttentionIn(L, a));
    if (on_device()) {
      RETURN_IF_ERROR(DecodeAttentionLayerOnDevice(li, batch, a, times));
    } else {
      RETURN_IF_ERROR(DecodeAttentionLayer(li, batch, a, observer, times));
    }
    RETURN_IF_ERROR(AttentionOutAndMlp(L, a));
  }
  return Logits(a, 0, logits);
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

// One layer's attention for a batch on a GPU: each sequence's new K/V row appended to its
// device cache (AppendKv), then decode attention over it, every sequence of one cache layout in
// one call each. Sequences with a selector (sparse attention) are selected on the host, as on
// the CPU backends: the layer's q and new K/V rows come back to the host, where the new row is
// also written to the host cache (the selector's page summaries read it), and the chosen
// indices go to the device for the attention kernel.
absl::Status LlamaModel::DecodeAttentionLayerOnDevice(int li, absl::Span<const DecodeInput> batch,
                                                      Activations& a, DecodeTimes* times) {
  const ModelConfig& c = config_;
  const int bsz = static_cast<int>(batch.size()), d = c.head_dim;
  const int qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t stride = qd + 2 * kvd;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  bool any_sparse = false;
  for (const DecodeInput& in : batch) any_sparse |= in.selector != nullptr;
  std::vector<float> qkv_host;
  const float* qkv = nullptr;  // the layer's rows on the host, when some sequence selects
  if (any_sparse) {
    ASSIGN_OR_RETURN(qkv, HostView(a.qkv, static_cast<size_t>(bsz) * stride, &qkv_host));
  }
  std::vector<kernels::KvAppend> appends(bsz);
  std::vector<DecodeSequence> seqs(bsz);
  std::vector<std::vector<int32_t>> indices(bsz);
  std::vector<std::pair<int, int>> heads;  // (sequence, cache head) to select for
  for (int b = 0; b < bsz; ++b) {
    LayerCache& lc = batch[b].cache->layer(li);
    DeviceKv::Layer& l = static_cast<DeviceKv*>(batch[b].cache->attachment())->layers[li];
    const int t = lc.len;
    // The host rows are written only for a selector (its page summaries read them); the
    // device copy's len follows once AppendKv has written the row there.
    const float* host_k = batch[b].selector ? qkv + b * stride + qd : nullptr;
    AppendToHostCache(lc, c.num_kv_heads, host_k, host_k ? host_k + kvd : nullptr,
                      batch[b].position);
    if (batch[b].selector) {
      ASSIGN_OR_RETURN(const int n, PlanSelection(*batch[b].selector, li, lc));
      if (n > 0) {
        indices[b].resize(static_cast<size_t>(lc.n_heads) * n);
        seqs[b].num_indices = n;
        for (int ch = 0; ch < lc.n_heads; ++ch) heads.emplace_back(b, ch);
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
  if (any_sparse) {
    backend_->HostParallelFor(static_cast<int64_t>(heads.size()), [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) {
        const auto [b, ch] = heads[h];
        int32_t* out = indices[b].data() + static_cast<size_t>(ch) * seqs[b].num_indices;
        batch[b].selector->SelectHead(li, qkv + b * stride, batch[b].cache->layer(li), ch, out);
      }
    });
    // Every sparse sequence's indices in one device buffer.
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
      if (batch[b].selector) {
        batch[b].selector->Done(li, qkv + b * stride, batch[b].cache->layer(li),
                                indices[b].empty() ? nullptr : indices[b].data(),
                                seqs[b].num_indices);
      }
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
  // Sequences grouped by cache layout (per KV head or per query head, dtype).
  std::vector<bool> done(bsz, false);
  for (int b0 = 0; b0 < bsz; ++b0) {
    if (done[b0]) continue;
    const KvCacheShape& shape = batch[b0].cache->shape();
    std::vector<kernels::KvAppend> group_appends;
    std::vector<DecodeSequence> group_seqs;
    std::vector<int> group;
    for (int b = b0; b < bsz; ++b) {
      const KvCacheShape& sb = batch[b].cache->shape();
      if (done[b] || sb.n_heads != shape.n_heads || sb.dtype != shape.dtype) continue;
      done[b] = true;
      group.push_back(b);
      group_appends.push_back(appends[b]);
      group_seqs.push_back(seqs[b]);
    }
    const int n = static_cast<int>(group_seqs.size());
    RETURN_IF_ERROR(backend_->AppendKv(
        {group_appends.data(), n, c.num_kv_heads, shape.n_heads, d, shape.dtype}));
    for (int b : group) {
      static_cast<DeviceKv*>(batch[b].cache->attachment())->layers[li].len =
          batch[b].cache->layer(li).len;
    }
    DecodeAttentionParams dp;
    dp.seqs = group_seqs.data();
    dp.batch = n;
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
