// The model's shape and hyper-parameters, read from a Hugging Face config.json
// (Llama, Mistral and Qwen2 families) or made up for a synthetic model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/dtype.h"

namespace kvwire {

// rope_scaling of config.json. "llama3" (Llama 3.1+) rescales frequencies by wavelength;
// "linear" divides positions by `factor`.
struct RopeScaling {
  std::string type;  // "llama3" or "linear"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
  std::string model_type;    // llama, mistral, qwen2
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-5f;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Llama attention_bias, always on for Qwen2
  bool o_bias = false;    // Llama attention_bias only
  bool mlp_bias = false;
  std::optional<int> sliding_window;  // Mistral: tokens a query may see
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;
  DType dtype = DType::kF32;  // torch_dtype: what the weights are stored in

  // Parses config.json text; `source` names the file in errors.
  static absl::StatusOr<ModelConfig> FromJson(absl::string_view text, absl::string_view source);
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);

  // Checks that the numbers fit together (heads divide, sizes positive, ...).
  absl::Status Validate(absl::string_view source) const;

  // The longest sequence (prompt + generated) the model may see.
  int context_limit() const;
  // Bytes of K and V for one token across all layers, at `kv_dtype`.
  int64_t KvBytesPerToken(DType kv_dtype) const;
  // Parameters of the transformer (embeddings counted once when tied).
  int64_t ParameterCount() const;
  // Frequencies of rotary embedding, [head_dim / 2], with rope_scaling applied.
  std::vector<float> RopeInvFreq() const;
};

}  // namespace kvwire
