// Synthetic models: the shapes of real models with deterministic random weights, for benchmarks
// and tests at sizes no model in ../shared has ("synthetic:llama-1b,layers=4").
#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/splitmix.h"
#include "common/base/status.h"
#include "common/model/llama_model.h"

namespace kvwire {
namespace {

// SplitMix64: a tiny, good-enough generator for synthetic weights, seekable by index so
// that any slice of a tensor can be filled independently and deterministically.
uint64_t SplitMix(uint64_t x) { return SplitMix64(x); }

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
    {"llama-8b", "Llama-3.1-8B shape: 32 layers, hidden 4096, 32 heads, 8 KV heads x 128, bf16", 32,
     4096, 32, 8, 128, 14336, 128256, 131072, DType::kBF16, 5e5},
    {"attn-8kv",
     "attention-bound: 2 layers, hidden 1024, 32 heads, 8 KV heads x 128, bf16, 32K context", 2,
     1024, 32, 8, 128, 1024, 1024, 32768, DType::kBF16, 5e5},
};

}  // namespace

std::string LlamaModel::SyntheticSpecHelp() {
  std::string s = "synthetic:NAME[,key=value...] with NAME one of:\n";
  for (const auto& p : kPresets) absl::StrAppend(&s, "  ", p.name, ": ", p.help, "\n");
  absl::StrAppend(&s,
                  "keys: layers, hidden, heads, kv_heads, head_dim, ffn, vocab, context, "
                  "dtype (f32|bf16|f16), theta, seed");
  return s;
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
  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto random_linear = [&](int out, int in) {
    // Uniform with variance 1/in, so activations keep their scale through the layers.
    const float a = std::sqrt(3.f / in);
    const uint64_t s = SplitMix(seed + 0x51ed27ull * ++tensor_index);
    const size_t n = static_cast<size_t>(out) * in;
    std::vector<uint8_t> bytes(n * DTypeSize(weight_dtype_));
    // Rows over the host's threads: each element is a function of its index alone, so the
    // weights are the same however they are split (an 8B model in seconds, not a minute).
    auto fill = [&](int begin, int end) {
      std::vector<float> row(in);
      for (int r = begin; r < end; ++r) {
        for (int i = 0; i < in; ++i) row[i] = a * UniformAt(s, static_cast<uint64_t>(r) * in + i);
        FromFloat(weight_dtype_, row.data(),
                  bytes.data() + static_cast<size_t>(r) * in * DTypeSize(weight_dtype_), in);
      }
    };
    const int parts = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, n >> 20)));
    std::vector<std::thread> workers;
    for (int t = 1; t < parts; ++t) {
      workers.emplace_back(fill, static_cast<int>(int64_t{out} * t / parts),
                           static_cast<int>(int64_t{out} * (t + 1) / parts));
    }
    fill(0, static_cast<int>(int64_t{out} / parts));
    for (std::thread& w : workers) w.join();
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

}  // namespace kvwire
