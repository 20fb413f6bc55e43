// The two translations meet: what the decode node accepts (TranslateGenerateRequest) and
// then asks of a prefill node (ToPrefillRequest, through the wire) the prefill node
// translates back unchanged (TranslatePrefillRequest) and its engine accepts
// (PrefillEngine::Check), for every policy, rocketkv once resolved. generate_request_fuzz
// checks the same over arbitrary requests.
#include "decode_service/translate.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/engine/prefill_engine.h"
#include "common/sparse/rocketkv.h"
#include "kvwire/v1/generation.pb.h"
#include "prefill_service/translate.h"

namespace kvwire {
namespace {

class TranslateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LoadOptions o;
    o.threads = 1;
    auto m = LlamaModel::Load("synthetic:tiny", o);
    ASSERT_TRUE(m.ok());
    model_ = std::move(*m);
    PrefillEngineOptions e;
    e.workers = 0;
    engine_ = std::make_unique<PrefillEngine>(model_.get(), e);
  }

  // The decode node's job for `req`, resolved and sent as the engine sends it; the prefill
  // node's job as it arrives.
  void RoundTrip(const v1::GenerateRequest& req) {
    auto job = TranslateGenerateRequest(req, *model_, DecodeServerOptions(), 1);
    ASSERT_TRUE(job.ok()) << job.status();
    const int len = static_cast<int>(job->prompt_ids.size());
    ASSERT_TRUE(ResolveTwoStage(&job->compression, &job->attention, len, job->max_tokens,
                                model_->config().head_dim)
                    .ok());
    PrefillJob sent;
    sent.request_id = job->request_id;
    sent.prompt_ids = job->prompt_ids;
    sent.compression = job->compression;
    sent.model_fingerprint = model_->fingerprint();
    sent.max_chunk_bytes = 4096;
    sent.sampling = job->sampling;
    sent.seed = job->seed;
    v1::PrefillRequest wire;
    ASSERT_TRUE(wire.ParseFromString(ToPrefillRequest(sent).SerializeAsString()));
    auto received = TranslatePrefillRequest(wire);
    ASSERT_TRUE(received.ok()) << received.status();
    EXPECT_EQ(received->request_id, sent.request_id);
    EXPECT_EQ(received->prompt_ids, sent.prompt_ids);
    EXPECT_EQ(received->compression.Describe(), sent.compression.Describe());
    EXPECT_EQ(received->model_fingerprint, sent.model_fingerprint);
    EXPECT_EQ(received->max_chunk_bytes, sent.max_chunk_bytes);
    EXPECT_EQ(received->sampling.temperature, sent.sampling.temperature);
    EXPECT_EQ(received->sampling.top_p, sent.sampling.top_p);
    EXPECT_EQ(received->sampling.top_k, sent.sampling.top_k);
    EXPECT_EQ(received->seed, sent.seed);
    EXPECT_TRUE(engine_->Check(*received).ok()) << engine_->Check(*received);
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<PrefillEngine> engine_;
};

v1::GenerateRequest Request(const std::string& policy, int budget) {
  v1::GenerateRequest r;
  for (int i = 0; i < 60; ++i) r.mutable_prompt_ids()->add_ids(3 + (7 * i) % 256);
  r.mutable_compression()->set_policy(policy);
  if (budget > 0) r.mutable_compression()->set_budget(budget);
  r.mutable_sampling()->set_max_tokens(16);
  r.mutable_sampling()->set_temperature(0.5f);
  r.mutable_sampling()->set_top_p(0.9f);
  r.mutable_sampling()->set_top_k(12);
  r.mutable_sampling()->set_seed(42);
  return r;
}

TEST_F(TranslateTest, WhatTheDecodeNodeSendsThePrefillNodeAccepts) {
  RoundTrip(Request("full", 0));
  RoundTrip(Request("snapkv_pp", 32));
  v1::GenerateRequest r = Request("snapkv", 24);
  r.mutable_compression()->set_gqa("per_query_head");
  r.mutable_compression()->set_pool("avg");
  r.mutable_compression()->set_kernel(3);
  r.mutable_compression()->set_skip_layers(1);
  RoundTrip(r);
  r = Request("streaming", 20);
  r.mutable_compression()->set_sinks(2);
  r.mutable_compression()->set_window(8);
  RoundTrip(r);
  r = Request("random", 0);
  r.mutable_compression()->set_ratio(0.4);
  r.mutable_compression()->set_seed(9);
  RoundTrip(r);
  r = Request("chunkkv", 30);
  r.mutable_compression()->set_chunk(4);
  r.mutable_compression()->set_reuse_layers(2);
  (*r.mutable_compression()->mutable_params())["chunk_scope"] = "per_kv_head";
  RoundTrip(r);
  r = Request("hbw", 32);
  r.mutable_compression()->set_block(2);
  r.mutable_compression()->add_groups(1);
  r.mutable_compression()->add_groups(4);
  RoundTrip(r);
}

TEST_F(TranslateTest, RocketKVGoesAsItsFirstStage) {
  v1::GenerateRequest r = Request("rocketkv", 40);
  (*r.mutable_compression()->mutable_params())["budget_split"] = "sqrt";
  RoundTrip(r);
}

// Found with an input written for generate_request_fuzz: a rocketkv budget above 2^26 (compression
// budgets go to 2^30) was accepted and became a stage-2 attention token budget beyond the
// attention's own limit, a configuration no request could set. It is refused, naming the budget.
TEST_F(TranslateTest, RocketKVBudgetWithinTheAttentionLimit) {
  v1::GenerateRequest r = Request("rocketkv", kMaxTokenBudget + 1);
  auto refused = TranslateGenerateRequest(r, *model_, DecodeServerOptions(), 1);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("rocketkv's compression.budget"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("2^26"), std::string::npos) << refused.status();

  r.mutable_compression()->set_budget(kMaxTokenBudget);
  auto job = TranslateGenerateRequest(r, *model_, DecodeServerOptions(), 1);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(ResolveTwoStage(&job->compression, &job->attention, 60, job->max_tokens,
                              model_->config().head_dim)
                  .ok());
  EXPECT_TRUE(job->attention.Validate().ok()) << job->attention.Validate();
  RoundTrip(r);
}

}  // namespace
}  // namespace kvwire
