// Retrieval through the service pair (a prefill node and a decode node, real gRPC servers on
// loopback) on the retrieval model of ../shared: SnapKV at budget 128 answers a fixed
// handful of dev prompts, StreamingLLM at 32 does not, each answer is the one the same
// compression gives in process, and the response's figures carry the stream's payload.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/engine/generate.h"
#include "decode_service/decode_server.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "prefill_service/prefill_server.h"
#include "tests/engine_fakes.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

class PasskeyPairTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVWIRE_REQUIRE_SHARED();
    prefill_model_ = testing::LoadModel(testing::PasskeyModelDir());
    decode_model_ = testing::LoadModel(testing::PasskeyModelDir());
    ASSERT_NE(prefill_model_, nullptr);
    ASSERT_NE(decode_model_, nullptr);
    engine_ = std::make_unique<PrefillEngine>(prefill_model_.get(), PrefillEngineOptions{});
    PrefillServerOptions p;
    p.listen = "127.0.0.1:0";
    auto prefill = PrefillServer::Start(engine_.get(), std::move(p));
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(*prefill);
    DecodeServerOptions d;
    d.listen = "127.0.0.1:0";
    d.prefill_target = "127.0.0.1:" + std::to_string(prefill_->port());
    auto decode = DecodeServer::Start(decode_model_.get(), std::move(d));
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = std::move(*decode);
    stub_ = v1::Generation::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(decode_->port()), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    decode_.reset();
    prefill_.reset();
    engine_.reset();
  }

  struct Answer {
    std::vector<int32_t> ids;
    v1::RequestStats stats;
  };
  Answer Ask(const testing::PasskeyCase& c, const std::string& policy, int budget,
             KvFormat format = KvFormat::kAuto) {
    v1::GenerateRequest req;
    if (format != KvFormat::kAuto) {
      req.mutable_compression()->set_kv_format(std::string(KvFormatName(format)));
    }
    for (int32_t id : c.prompt_ids) req.mutable_prompt_ids()->add_ids(id);
    req.mutable_sampling()->set_max_tokens(static_cast<int>(c.answer_ids.size()));
    req.mutable_sampling()->set_temperature(0);
    req.mutable_sampling()->set_ignore_eos(true);
    req.mutable_compression()->set_policy(policy);
    req.mutable_compression()->set_budget(budget);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub_->Generate(&ctx, req);
    Answer a;
    v1::GenerateResponse r;
    while (reader->Read(&r)) {
      a.ids.insert(a.ids.end(), r.token_ids().begin(), r.token_ids().end());
      if (r.has_final()) a.stats = r.final().stats();
    }
    const grpc::Status st = reader->Finish();
    EXPECT_TRUE(st.ok()) << c.id << ": " << st.error_message();
    return a;
  }
  std::vector<int32_t> InProcess(const testing::PasskeyCase& c, const std::string& policy,
                                 int budget, KvFormat format = KvFormat::kAuto) {
    GenerationRequest req = testing::PasskeyRequest(c, policy, budget);
    req.compression.kv_format = format;
    auto r = Generate(*prefill_model_, req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->ids : std::vector<int32_t>{};
  }

  std::unique_ptr<LlamaModel> prefill_model_, decode_model_;
  std::unique_ptr<PrefillEngine> engine_;
  std::unique_ptr<PrefillServer> prefill_;
  std::unique_ptr<DecodeServer> decode_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(PasskeyPairTest, SnapKvAt128AnswersStreamingAt32DoesNot) {
  // Under ASan the handful took five minutes of CI's two cores; its shortest prompt takes every
  // path of the pair that the others do.
  const std::vector<std::string> ids =
      testing::kSanitized ? std::vector<std::string>{testing::kPasskeyHandful.front()}
                          : testing::kPasskeyHandful;
  const auto cases = testing::ReadPasskeyCases(ids);
  ASSERT_EQ(cases.size(), ids.size());
  const ModelConfig& mc = decode_model_->config();
  // One row of the stream per kept token and KV head: its K and V, and its position coded in
  // at most 2 bytes (gaps below 2^14) behind a byte of coding per head.
  const DType kv = decode_model_->kv_dtype();
  const int64_t heads = int64_t{mc.num_layers} * mc.num_kv_heads;
  const int64_t rows = heads * 128 * 2 * mc.head_dim * DTypeSize(kv);
  for (const auto& c : cases) {
    const int len = static_cast<int>(c.prompt_ids.size());
    const Answer snapkv = Ask(c, "snapkv", 128);
    EXPECT_EQ(snapkv.ids, c.answer_ids) << c.id;
    EXPECT_EQ(snapkv.ids, InProcess(c, "snapkv", 128)) << c.id;
    EXPECT_EQ(snapkv.stats.full_cache_bytes(), int64_t{len} * mc.KvBytesPerToken(kv));
    EXPECT_GT(snapkv.stats.kv_payload_bytes(), rows + heads) << c.id;
    EXPECT_LE(snapkv.stats.kv_payload_bytes(), rows + heads * (1 + 2 * 128)) << c.id;
    EXPECT_GT(snapkv.stats.wire_bytes(), snapkv.stats.kv_payload_bytes());
    EXPECT_LT(snapkv.stats.wire_bytes(), snapkv.stats.kv_payload_bytes() * 1.01);

    // Quantised on the wire: the same answer through the pair as in process, in a fraction of
    // the bytes (docs/wire_format.md, "Row formats"), and still the right one.
    for (KvFormat format : {KvFormat::kFP8, KvFormat::kInt4}) {
      const Answer q = Ask(c, "snapkv", 128, format);
      EXPECT_EQ(q.ids, InProcess(c, "snapkv", 128, format)) << c.id << " " << KvFormatName(format);
      const int64_t q_rows =
          heads * static_cast<int64_t>(KvKeyBlockBytes(format, kv, mc.head_dim, 128, 0, 128) +
                                       KvValueBlockBytes(format, kv, mc.head_dim, 128, 0, 128));
      EXPECT_GT(q.stats.kv_payload_bytes(), q_rows + heads) << c.id;
      EXPECT_LE(q.stats.kv_payload_bytes(), q_rows + heads * (1 + 2 * 128)) << c.id;
      EXPECT_EQ(q.ids, c.answer_ids) << c.id << " " << KvFormatName(format);
    }

    const Answer streaming = Ask(c, "streaming", 32);
    EXPECT_NE(streaming.ids, c.answer_ids) << c.id;
    EXPECT_EQ(streaming.ids, InProcess(c, "streaming", 32)) << c.id;
  }
}

}  // namespace
}  // namespace kvwire
