#include "common/model/model_config.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

using nlohmann::json;

absl::Status ConfigError(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
}

// Reads an integer field; `required` fields that are absent are errors.
absl::Status ReadInt(const json& j, const char* key, bool required, absl::string_view source,
                     int* out) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) return ConfigError(source, absl::StrCat("missing required field \"", key, "\""));
    return absl::OkStatus();
  }
  const json& v = j[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1ll << 31) - 1) {
    return ConfigError(
        source, absl::StrCat("\"", key, "\" must be a non-negative integer, got ", v.dump()));
  }
  *out = static_cast<int>(v.get<int64_t>());
  return absl::OkStatus();
}

absl::Status ReadNumber(const json& j, const char* key, absl::string_view source, double* out) {
  if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
  if (!j[key].is_number()) {
    return ConfigError(source, absl::StrCat("\"", key, "\" must be a number, got ", j[key].dump()));
  }
  *out = j[key].get<double>();
  return absl::OkStatus();
}

absl::Status ReadBool(const json& j, const char* key, absl::string_view source, bool* out) {
  if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
  if (!j[key].is_boolean()) {
    return ConfigError(source,
                       absl::StrCat("\"", key, "\" must be true or false, got ", j[key].dump()));
  }
  *out = j[key].get<bool>();
  return absl::OkStatus();
}

// An integer token id, before it is narrowed to int32 (which would wrap 2^32 + 5 to 5);
// Validate checks the ids that fit against the vocabulary.
absl::StatusOr<int32_t> ReadTokenId(const json& v, const char* key, int vocab_size,
                                    absl::string_view source) {
  const bool fits =
      v.is_number_unsigned() ? v.get<uint64_t>() <= INT32_MAX : v.get<int64_t>() >= INT32_MIN;
  if (!fits) {
    return ConfigError(
        source, absl::StrCat(key, " ", v.dump(), " is outside the vocabulary of ", vocab_size));
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat(path, ": cannot open (is --model a model folder?)"));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromJson(ss.str(), path);
}

absl::StatusOr<ModelConfig> ModelConfig::FromJson(absl::string_view text,
                                                  absl::string_view source) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return ConfigError(source, absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return ConfigError(source, "expected a JSON object");

  ModelConfig c;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string()) {
    c.architecture = j["architectures"][0].get<std::string>();
  }
  if (j.contains("model_type") && j["model_type"].is_string()) {
    c.model_type = j["model_type"].get<std::string>();
  }
  if (c.model_type.empty() && c.architecture.empty()) {
    return ConfigError(source, "neither \"model_type\" nor \"architectures\" is given");
  }
  const bool llama = c.model_type == "llama" || c.architecture == "LlamaForCausalLM";
  const bool mistral = c.model_type == "mistral" || c.architecture == "MistralForCausalLM";
  const bool qwen2 = c.model_type == "qwen2" || c.architecture == "Qwen2ForCausalLM";
  if (!llama && !mistral && !qwen2) {
    return absl::UnimplementedError(absl::StrCat(
        source, ": unsupported architecture (model_type \"", c.model_type, "\", architectures \"",
        c.architecture, "\"); kvwire runs the Llama, Mistral and Qwen2 families"));
  }
  if (c.model_type.empty()) c.model_type = llama ? "llama" : mistral ? "mistral" : "qwen2";

  RETURN_IF_ERROR(ReadInt(j, "hidden_size", true, source, &c.hidden_size));
  RETURN_IF_ERROR(ReadInt(j, "intermediate_size", true, source, &c.intermediate_size));
  RETURN_IF_ERROR(ReadInt(j, "num_hidden_layers", true, source, &c.num_layers));
  RETURN_IF_ERROR(ReadInt(j, "num_attention_heads", true, source, &c.num_heads));
  c.num_kv_heads = c.num_heads;
  RETURN_IF_ERROR(ReadInt(j, "num_key_value_heads", false, source, &c.num_kv_heads));
  RETURN_IF_ERROR(ReadInt(j, "vocab_size", true, source, &c.vocab_size));
  c.max_position_embeddings = 2048;
  RETURN_IF_ERROR(ReadInt(j, "max_position_embeddings", false, source, &c.max_position_embeddings));
  if (c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  RETURN_IF_ERROR(ReadInt(j, "head_dim", false, source, &c.head_dim));

  double eps = c.rms_norm_eps;
  RETURN_IF_ERROR(ReadNumber(j, "rms_norm_eps", source, &eps));
  c.rms_norm_eps = static_cast<float>(eps);
  RETURN_IF_ERROR(ReadNumber(j, "rope_theta", source, &c.rope_theta));
  RETURN_IF_ERROR(ReadBool(j, "tie_word_embeddings", source, &c.tie_word_embeddings));
  bool attention_bias = false;
  RETURN_IF_ERROR(ReadBool(j, "attention_bias", source, &attention_bias));
  c.qkv_bias = attention_bias || qwen2;  // Qwen2 always has q/k/v biases
  c.o_bias = attention_bias && !qwen2;
  RETURN_IF_ERROR(ReadBool(j, "mlp_bias", source, &c.mlp_bias));

  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    return absl::UnimplementedError(absl::StrCat(source, ": hidden_act ", j["hidden_act"].dump(),
                                                 " is not supported; expected \"silu\""));
  }
  bool use_sliding = !qwen2;  // Qwen2 configs carry sliding_window but disable it
  RETURN_IF_ERROR(ReadBool(j, "use_sliding_window", source, &use_sliding));
  if (use_sliding) {
    int window = 0;
    RETURN_IF_ERROR(ReadInt(j, "sliding_window", false, source, &window));
    if (window > 0) c.sliding_window = window;
  }

  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    if (!rs.is_object()) return ConfigError(source, "\"rope_scaling\" must be an object or null");
    std::string type;
    for (const char* key : {"rope_type", "type"}) {
      if (rs.contains(key) && rs[key].is_string()) {
        type = rs[key].get<std::string>();
        break;
      }
    }
    if (type != "llama3" && type != "linear" && type != "default") {
      return absl::UnimplementedError(
          absl::StrCat(source, ": rope_scaling type \"", type,
                       "\" is not supported; expected llama3 or linear"));
    }
    if (type != "default") {
      RopeScaling s;
      s.type = type;
      RETURN_IF_ERROR(ReadNumber(rs, "factor", source, &s.factor));
      RETURN_IF_ERROR(ReadNumber(rs, "low_freq_factor", source, &s.low_freq_factor));
      RETURN_IF_ERROR(ReadNumber(rs, "high_freq_factor", source, &s.high_freq_factor));
      RETURN_IF_ERROR(ReadInt(rs, "original_max_position_embeddings", false, source,
                              &s.original_max_position_embeddings));
      if (!(s.factor > 0) || (type == "llama3" && !(s.high_freq_factor > s.low_freq_factor))) {
        return ConfigError(source,
                           "rope_scaling needs factor > 0 and high_freq_factor > "
                           "low_freq_factor");
      }
      c.rope_scaling = s;
    }
  }

  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer()) {
    ASSIGN_OR_RETURN(c.bos_token_id,
                     ReadTokenId(j["bos_token_id"], "bos_token_id", c.vocab_size, source));
  }
  if (j.contains("eos_token_id")) {
    const json& e = j["eos_token_id"];
    if (e.is_number_integer()) {
      ASSIGN_OR_RETURN(const int32_t id, ReadTokenId(e, "eos_token_id", c.vocab_size, source));
      c.eos_token_ids.push_back(id);
    } else if (e.is_array()) {
      for (const json& x : e) {
        if (!x.is_number_integer())
          return ConfigError(source, "eos_token_id entries must be integers");
        ASSIGN_OR_RETURN(const int32_t id, ReadTokenId(x, "eos_token_id", c.vocab_size, source));
        c.eos_token_ids.push_back(id);
      }
    } else if (!e.is_null()) {
      return ConfigError(source, "eos_token_id must be an integer or a list of integers");
    }
  }
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) {
    auto dt = ParseDType(j["torch_dtype"].get<std::string>());
    if (!dt.ok()) return Annotate(dt.status(), absl::StrCat(source, ": torch_dtype"));
    c.dtype = *dt;
  }
  RETURN_IF_ERROR(c.Validate(source));
  return c;
}

absl::Status ModelConfig::Validate(absl::string_view source) const {
  if (hidden_size <= 0 || intermediate_size <= 0 || num_layers <= 0 || num_heads <= 0 ||
      num_kv_heads <= 0 || head_dim <= 0 || vocab_size <= 0 || max_position_embeddings <= 0) {
    return ConfigError(source,
                       "hidden_size, intermediate_size, num_hidden_layers, "
                       "num_attention_heads, num_key_value_heads, head_dim, vocab_size and "
                       "max_position_embeddings must all be positive");
  }
  // Far above any real model (Llama 3.1 405B: hidden 16384, intermediate 53248, 126 layers,
  // 128 heads of 128, a 128256-token vocabulary), and low enough that what is derived from
  // them (parameter and byte counts in int64, the rotary table, per-layer buffers) neither
  // overflows nor asks for absurd allocations.
  struct Bound {
    const char* name;
    int value, max;
  };
  for (const Bound& b :
       {Bound{"hidden_size", hidden_size, 1 << 20},
        Bound{"intermediate_size", intermediate_size, 1 << 22},
        Bound{"num_hidden_layers", num_layers, 1 << 12},
        Bound{"num_attention_heads", num_heads, 1 << 12}, Bound{"head_dim", head_dim, 1 << 12},
        Bound{"vocab_size", vocab_size, 1 << 24}}) {
    if (b.value > b.max) {
      return ConfigError(source,
                         absl::StrCat(b.name, " is ", b.value, "; kvwire accepts at most ", b.max));
    }
  }
  if (num_heads % num_kv_heads != 0) {
    return ConfigError(
        source, absl::StrCat("num_attention_heads (", num_heads,
                             ") must be a multiple of num_key_value_heads (", num_kv_heads, ")"));
  }
  if (head_dim % 2 != 0) {
    return ConfigError(source,
                       absl::StrCat("head_dim must be even for rotary embeddings, got ", head_dim));
  }
  if (!(rms_norm_eps >= 0) || !(rope_theta > 0)) {
    return ConfigError(source, "rms_norm_eps must be >= 0 and rope_theta > 0");
  }
  for (int32_t e : eos_token_ids) {
    if (e < 0 || e >= vocab_size) {
      return ConfigError(
          source, absl::StrCat("eos_token_id ", e, " is outside the vocabulary of ", vocab_size));
    }
  }
  if (bos_token_id && (*bos_token_id < 0 || *bos_token_id >= vocab_size)) {
    return ConfigError(source, absl::StrCat("bos_token_id ", *bos_token_id,
                                            " is outside the vocabulary of ", vocab_size));
  }
  return absl::OkStatus();
}

int ModelConfig::context_limit() const {
  return sliding_window ? std::min(*sliding_window, max_position_embeddings)
                        : max_position_embeddings;
}

int64_t ModelConfig::KvBytesPerToken(DType kv_dtype) const {
  return int64_t{2} * num_layers * num_kv_heads * head_dim *
         static_cast<int64_t>(DTypeSize(kv_dtype));
}

int64_t ModelConfig::ParameterCount() const {
  const int64_t h = hidden_size;
  const int64_t attn =
      h * (int64_t{num_heads} * head_dim) * 2 + h * (int64_t{num_kv_heads} * head_dim) * 2;
  const int64_t mlp = 3 * h * intermediate_size;
  const int64_t per_layer = attn + mlp + 2 * h;
  const int64_t emb = int64_t{vocab_size} * h * (tie_word_embeddings ? 1 : 2);
  return per_layer * num_layers + emb + h;
}

// Hugging Face's _compute_default_rope_parameters and _compute_llama3_parameters.
std::vector<float> ModelConfig::RopeInvFreq() const {
  const int half = head_dim / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    // Exponent in float32 as torch computes arange(0, d, 2).float() / d.
    const float expo = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = static_cast<float>(1.0 / std::pow(rope_theta, static_cast<double>(expo)));
  }
  if (!rope_scaling) return inv;
  const RopeScaling& s = *rope_scaling;
  if (s.type == "linear") {
    for (float& f : inv) f = static_cast<float>(f / s.factor);
    return inv;
  }
  const double old_ctx = s.original_max_position_embeddings;
  const double low_wavelen = old_ctx / s.low_freq_factor;
  const double high_wavelen = old_ctx / s.high_freq_factor;
  for (float& f : inv) {
    const double wavelen = 2 * M_PI / f;
    if (wavelen < high_wavelen) continue;  // high frequency: unchanged
    if (wavelen > low_wavelen) {           // low frequency: scaled down by factor
      f = static_cast<float>(f / s.factor);
      continue;
    }
    const double smooth =
        (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = static_cast<float>((1 - smooth) * f / s.factor + smooth * f);
  }
  return inv;
}

}  // namespace kvwire
