#include "common/model/model_config.h"

#include <gtest/gtest.h>

#include <cmath>

#include "tests/test_util.h"

namespace kvwire {
namespace {

constexpr char kLlama31[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
  "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"})";

TEST(ModelConfig, ReadsTheStoriesModel) {
  KVWIRE_REQUIRE_SHARED();
  auto c = ModelConfig::FromFile(testing::StoriesModelDir() + "/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_layers, 5);
  EXPECT_EQ(c->num_heads, 8);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->vocab_size, 512);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c->dtype, DType::kF32);
  // 2 (K and V) · 5 layers · 4 KV heads · 8 dims · 4 bytes
  EXPECT_EQ(c->KvBytesPerToken(DType::kF32), 1280);
}

TEST(ModelConfig, Llama31RopeScaling) {
  auto c = ModelConfig::FromJson(kLlama31, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->dtype, DType::kBF16);
  EXPECT_EQ(c->eos_token_ids.size(), 3u);
  ASSERT_TRUE(c->rope_scaling);
  const std::vector<float> inv = c->RopeInvFreq();
  ASSERT_EQ(inv.size(), 64u);
  const double two_pi = 2 * M_PI;
  for (int i = 0; i < 64; ++i) {
    const double base = 1.0 / std::pow(500000.0, 2.0 * i / 128);
    const double wavelen = two_pi / base;
    if (wavelen < 8192 / 4.0) {
      EXPECT_NEAR(inv[i] / base, 1.0, 1e-6) << i;  // high frequency: unchanged
    } else if (wavelen > 8192 / 1.0) {
      EXPECT_NEAR(inv[i] / base, 1.0 / 8, 1e-6) << i;  // low frequency: divided by factor
    } else {
      EXPECT_LT(inv[i], base) << i;  // smooth interpolation in between
      EXPECT_GT(inv[i], base / 8) << i;
    }
  }
}

TEST(ModelConfig, Qwen2HasQkvBiasAndNoSlidingWindowWhenDisabled) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "sliding_window": 32768, "use_sliding_window": false,
    "tie_word_embeddings": true, "rope_theta": 1000000.0})",
                                 "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_FALSE(c->sliding_window);
  EXPECT_EQ(c->head_dim, 64);
}

TEST(ModelConfig, MistralSlidingWindowLimitsContext) {
  auto c =
      ModelConfig::FromJson(R"({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 32768, "sliding_window": 4096})",
                            "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->context_limit(), 4096);
}

TEST(ModelConfig, ErrorsNameTheFileAndTheField) {
  struct Case {
    std::string json;
    absl::StatusCode code;
    std::string expect;
  };
  std::vector<Case> cases = {
      {"{", absl::StatusCode::kInvalidArgument, "not valid JSON"},
      {R"({"model_type": "gpt2", "hidden_size": 8})", absl::StatusCode::kUnimplemented, "gpt2"},
      {R"({"model_type": "llama", "hidden_size": 64})", absl::StatusCode::kInvalidArgument,
       "intermediate_size"},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 4,
           "vocab_size": 10})",
       absl::StatusCode::kInvalidArgument, "multiple of num_key_value_heads"},
      {R"({"model_type": "llama", "hidden_size": "64", "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10})",
       absl::StatusCode::kInvalidArgument, "\"hidden_size\" must be a non-negative integer"},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10,
           "rope_scaling": {"rope_type": "yarn", "factor": 4}})",
       absl::StatusCode::kUnimplemented, "yarn"},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10,
           "eos_token_id": 99})",
       absl::StatusCode::kInvalidArgument, "outside the vocabulary"},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10,
           "hidden_act": "gelu"})",
       absl::StatusCode::kUnimplemented, "hidden_act"},
  };
  // Inputs that crashed fuzz/model_config_fuzz (its corpus keeps them as ubsan-*.json and
  // oom-*.json): sizes that passed Validate overflowed ParameterCount (signed overflow) and
  // made RopeInvFreq allocate 4 GB. And ids past int32, which wrapped into the vocabulary.
  const std::vector<Case> fuzzed = {
      {R"({"model_type":"llama","hidden_size":2147483647,"intermediate_size":2147483647,
           "num_hidden_layers":2147483647,"num_attention_heads":1,"head_dim":2,
           "vocab_size":2147483647})",
       absl::StatusCode::kInvalidArgument, "hidden_size is 2147483647; kvwire accepts at most"},
      {R"({"model_type":"llama","hidden_size":64,"intermediate_size":2,"num_hidden_layers":1,
           "num_attention_heads":1,"head_dim":2000000000,"vocab_size":10})",
       absl::StatusCode::kInvalidArgument, "head_dim is 2000000000; kvwire accepts at most 4096"},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10,
           "bos_token_id": 4294967301})",
       absl::StatusCode::kInvalidArgument, "bos_token_id 4294967301 is outside the vocabulary"},
      {R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10,
           "eos_token_id": [1, -4294967295]})",
       absl::StatusCode::kInvalidArgument, "eos_token_id -4294967295 is outside the vocabulary"},
  };
  for (const Case& c : fuzzed) cases.push_back(c);
  for (const Case& c : cases) {
    auto r = ModelConfig::FromJson(c.json, "some/config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    const std::string msg(r.status().message());
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    EXPECT_NE(msg.find("some/config.json"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace kvwire
