// Traces across the pair: a client's W3C traceparent reaches the decode node and, through
// gRPC metadata, the prefill node; both export OTLP-JSON lines; the spans form one tree;
// the KV transfer span's byte counts equal the figures the response reported. And the
// nodes' graceful shutdown lets an in-flight request finish.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/telemetry/telemetry.h"
#include "decode_service/decode_server.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "prefill_service/prefill_server.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

using nlohmann::json;

std::vector<json> ReadSpans(const std::string& path) {
  std::vector<json> spans;
  std::istringstream in(testing::ReadFile(path));
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    for (const auto& rs : j["resourceSpans"]) {
      for (const auto& ss : rs["scopeSpans"]) {
        for (const auto& sp : ss["spans"]) spans.push_back(sp);
      }
    }
  }
  return spans;
}

std::string Attr(const json& span, const std::string& key) {
  for (const auto& a : span["attributes"]) {
    if (a["key"] == key) {
      const auto& v = a["value"];
      if (v.contains("intValue")) return v["intValue"].get<std::string>();
      if (v.contains("stringValue")) return v["stringValue"].get<std::string>();
      return v.dump();
    }
  }
  return "";
}

class TracingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("traces");
    LoadOptions o;
    o.threads = 1;
    auto m = LlamaModel::Load(
        testing::SharedDir().empty() ? "synthetic:stories" : testing::StoriesModelDir(), o);
    ASSERT_TRUE(m.ok());
    model_ = std::move(*m);
    auto pt = Telemetry::Create({"prefill", "p1", "", dir_ + "/prefill.jsonl"});
    auto dt = Telemetry::Create({"decode", "d1", "", dir_ + "/decode.jsonl"});
    ASSERT_TRUE(pt.ok() && dt.ok());
    prefill_telemetry_ = std::move(*pt);
    decode_telemetry_ = std::move(*dt);
    PrefillEngineOptions pe;
    pe.telemetry = prefill_telemetry_.get();
    prefill_engine_ = std::make_unique<PrefillEngine>(model_.get(), pe);
    PrefillServerOptions po;
    po.listen = "127.0.0.1:0";
    po.telemetry = prefill_telemetry_.get();
    prefill_ = *PrefillServer::Start(prefill_engine_.get(), po);
    DecodeServerOptions dopt;
    dopt.listen = "127.0.0.1:0";
    dopt.prefill_target = "127.0.0.1:" + std::to_string(prefill_->port());
    dopt.telemetry = decode_telemetry_.get();
    decode_ = *DecodeServer::Start(model_.get(), dopt);
    stub_ = v1::Generation::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(decode_->port()), grpc::InsecureChannelCredentials()));
  }

  std::string dir_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Telemetry> prefill_telemetry_, decode_telemetry_;
  std::unique_ptr<PrefillEngine> prefill_engine_;
  std::unique_ptr<PrefillServer> prefill_;
  std::unique_ptr<DecodeServer> decode_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(TracingTest, OneTraceFromClientToPrefillNode) {
  const std::string trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
  const std::string client_span = "00f067aa0ba902b7";
  grpc::ClientContext ctx;
  ctx.AddMetadata("traceparent", "00-" + trace_id + "-" + client_span + "-01");
  v1::GenerateRequest req;
  for (int i = 0; i < 200; ++i) req.mutable_prompt_ids()->add_ids(i == 0 ? 1 : 3 + (i * 13) % 400);
  req.mutable_sampling()->set_max_tokens(6);
  req.mutable_compression()->set_policy("snapkv");
  req.mutable_compression()->set_budget(48);
  auto reader = stub_->Generate(&ctx, req);
  v1::GenerateResponse msg;
  v1::RequestStats stats;
  while (reader->Read(&msg)) {
    if (msg.has_final()) stats = msg.final().stats();
  }
  ASSERT_TRUE(reader->Finish().ok());
  decode_.reset();  // flush and close the trace files
  prefill_.reset();
  prefill_engine_.reset();
  decode_telemetry_.reset();
  prefill_telemetry_.reset();

  std::vector<json> spans = ReadSpans(dir_ + "/decode.jsonl");
  const std::vector<json> prefill_spans = ReadSpans(dir_ + "/prefill.jsonl");
  spans.insert(spans.end(), prefill_spans.begin(), prefill_spans.end());
  std::map<std::string, std::vector<json>> by_name;
  std::map<std::string, json> by_id;
  for (const json& s : spans) {
    EXPECT_EQ(s["traceId"], trace_id) << s["name"];
    by_name[s["name"].get<std::string>()].push_back(s);
    by_id[s["spanId"].get<std::string>()] = s;
  }
  auto one = [&](const std::string& name) -> json {
    EXPECT_EQ(by_name[name].size(), 1u) << name;
    return by_name[name].empty() ? json() : by_name[name][0];
  };
  auto parent_of = [&](const json& s) { return s.value("parentSpanId", std::string()); };
  const json request = one("decode.request");
  EXPECT_EQ(parent_of(request), client_span);
  const json rpc = one("decode.prefill_rpc");
  EXPECT_EQ(Attr(rpc, "prefill.route"), "round_robin");  // no --prefill-affinity-tokens
  EXPECT_EQ(parent_of(one("decode.queue")), request["spanId"].get<std::string>());
  EXPECT_EQ(parent_of(rpc), request["spanId"].get<std::string>());
  EXPECT_EQ(parent_of(one("decode.generate")), request["spanId"].get<std::string>());
  const json transfer = one("decode.kv_transfer");
  EXPECT_EQ(parent_of(transfer), rpc["spanId"].get<std::string>());
  const json serve = one("prefill.serve");
  EXPECT_EQ(parent_of(serve), rpc["spanId"].get<std::string>())
      << "traceparent crossed the Prefill RPC";
  const json forward = one("prefill.forward");
  EXPECT_EQ(parent_of(forward), serve["spanId"].get<std::string>());
  EXPECT_EQ(static_cast<int>(by_name["prefill.compress"].size()), model_->config().num_layers);
  for (const json& c : by_name["prefill.compress"])
    EXPECT_EQ(parent_of(c), forward["spanId"].get<std::string>());
  // The transfer span's byte counts are the response's figures.
  EXPECT_EQ(Attr(transfer, "kv.wire_bytes"), std::to_string(stats.wire_bytes()));
  EXPECT_EQ(Attr(transfer, "kv.full_bytes"), std::to_string(stats.full_cache_bytes()));
  EXPECT_EQ(Attr(request, "kv.wire_bytes"), std::to_string(stats.wire_bytes()));
  EXPECT_EQ(Attr(request, "kv.kept_tokens"), "48");
  EXPECT_EQ(Attr(serve, "kv.wire_bytes"), std::to_string(stats.wire_bytes()));
  EXPECT_EQ(Attr(serve, "budget"), "48");
}

TEST_F(TracingTest, NoTraceparentStartsANewTrace) {
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.mutable_prompt_ids()->add_ids(1);
  req.mutable_sampling()->set_max_tokens(2);
  auto reader = stub_->Generate(&ctx, req);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  ASSERT_TRUE(reader->Finish().ok());
  decode_.reset();
  prefill_.reset();
  prefill_engine_.reset();
  decode_telemetry_.reset();
  prefill_telemetry_.reset();
  const auto spans = ReadSpans(dir_ + "/decode.jsonl");
  ASSERT_FALSE(spans.empty());
  for (const json& s : spans) {
    if (s["name"] == "decode.request") {
      EXPECT_FALSE(s.contains("parentSpanId"));
    }
    EXPECT_EQ(s["traceId"].get<std::string>().size(), 32u);
  }
}

TEST_F(TracingTest, GracefulShutdownLetsInFlightRequestsFinish) {
  v1::GenerateRequest req;
  for (int i = 0; i < 100; ++i) req.mutable_prompt_ids()->add_ids(i == 0 ? 1 : 3 + i);
  req.mutable_sampling()->set_max_tokens(300);
  req.mutable_sampling()->set_ignore_eos(true);
  grpc::Status status;
  int tokens = 0;
  std::atomic<bool> started{false};
  std::thread client([&] {
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      tokens += msg.token_ids_size();
      started = true;
    }
    status = reader->Finish();
  });
  while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  decode_->Shutdown(/*grace_ms=*/20000);  // as on SIGTERM
  client.join();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, 300);
}

}  // namespace
}  // namespace kvwire
