// Loading a Hugging Face folder's weights: config.json, the safetensors tensors checked against
// it (shapes, dtypes), converted to the weight dtype where one is asked for.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/model/llama_model.h"
#include "common/model/safetensors.h"

namespace kvwire {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

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

}  // namespace kvwire
