// The prefill node on its own, called as the decode node calls it: the stream's
// structure (header, chunks tiling every layer in order, trailer), its content (what a
// local prefill with the same policy keeps), and its refusals.
#include "prefill_service/prefill_server.h"

#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <limits>
#include <thread>

#include "common/engine/generate.h"
#include "common/server/server_main.h"
#include "common/wire/kv_wire.h"
#include "kvwire/v1/prefill.grpc.pb.h"
#include "proto/convert.h"
#include "tests/engine_fakes.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

std::string ModelSpec() {
  return testing::SharedDir().empty() ? "synthetic:stories" : testing::StoriesModelDir();
}

class PrefillServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::LoadModel(ModelSpec());
    ASSERT_NE(model_, nullptr);
  }
  // A prefill node: its engine, optionally behind a fault injector, and its gRPC server.
  void Start(PrefillEngineOptions e = {}, testing::FaultyPrefills::Plan faults = {},
             PrefillServerOptions o = {}) {
    engine_ = std::make_unique<PrefillEngine>(model_.get(), e);
    faults_ = std::make_unique<testing::FaultyPrefills>(engine_.get(), faults);
    o.listen = "127.0.0.1:0";
    auto s = PrefillServer::Start(faults_.get(), std::move(o));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = v1::Prefill::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                                     grpc::InsecureChannelCredentials()));
  }
  v1::PrefillRequest Request(int len, const CompressionConfig& c) {
    v1::PrefillRequest r;
    r.set_request_id("t");
    r.add_prompt_ids(1);
    for (int i = 1; i < len; ++i) r.add_prompt_ids(3 + (i * 37) % 400);
    *r.mutable_compression() = ToProto(c);
    r.set_model_fingerprint(model_->fingerprint());
    return r;
  }
  struct Reply {
    grpc::Status status;
    std::vector<v1::PrefillResponse> messages;
  };
  Reply Call(const v1::PrefillRequest& req, const std::string& authorization = "") {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
    Reply r;
    auto reader = stub_->Prefill(&ctx, req);
    v1::PrefillResponse m;
    while (reader->Read(&m)) r.messages.push_back(m);
    r.status = reader->Finish();
    return r;
  }

  std::unique_ptr<LlamaModel> model_;
  // Destroyed bottom up: the server, the engine (its workers may be in the injector), the injector.
  std::unique_ptr<testing::FaultyPrefills> faults_;
  std::unique_ptr<PrefillEngine> engine_;
  std::unique_ptr<PrefillServer> server_;
  std::unique_ptr<v1::Prefill::Stub> stub_;
};

TEST_F(PrefillServerTest, StreamCarriesWhatALocalPrefillKeeps) {
  Start();
  CompressionConfig c;
  c.policy = *MakePolicy("hbw");
  c.budget = 64;
  const v1::PrefillRequest req = Request(300, c);
  const Reply r = Call(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_GE(r.messages.size(), 3u);
  ASSERT_TRUE(r.messages.front().has_header());
  ASSERT_TRUE(r.messages.back().has_trailer());
  auto header = FromProto(r.messages.front().header());
  ASSERT_TRUE(header.ok());
  const ModelConfig& mc = model_->config();
  EXPECT_EQ(header->format_version, kWireFormatVersion);
  EXPECT_EQ(header->num_layers, mc.num_layers);
  EXPECT_EQ(header->num_cache_heads, mc.num_kv_heads);
  EXPECT_EQ(header->prompt_len, 300);
  EXPECT_EQ(header->kept_per_layer, std::vector<int>(mc.num_layers, 64));
  EXPECT_NE(header->policy.find("hbw(budget=64"), std::string::npos) << header->policy;

  // Reassemble as the decode node does and compare with a local compressed prefill.
  std::vector<int32_t> ids(req.prompt_ids().begin(), req.prompt_ids().end());
  auto local = PrefillSequence(*model_, ids, c, 0);
  ASSERT_TRUE(local.ok());
  auto cache = KvCache::Create(local->cache->shape(), HeapKvAllocator());
  ASSERT_TRUE(cache.ok());
  WireExpectation e;
  e.model_fingerprint = model_->fingerprint();
  e.num_layers = mc.num_layers;
  e.num_cache_heads = mc.num_kv_heads;
  e.head_dim = mc.head_dim;
  e.dtype = model_->kv_dtype();
  e.prompt_len = 300;
  KvAssembler a(e, cache->get());
  ASSERT_TRUE(a.OnHeader(*header).ok());
  for (size_t i = 1; i + 1 < r.messages.size(); ++i) {
    ASSERT_TRUE(r.messages[i].has_chunk()) << i;
    v1::KvChunk chunk = r.messages[i].chunk();
    ASSERT_TRUE(a.OnChunk(FromProto(&chunk)).ok());
  }
  const WireTrailer t = FromProto(r.messages.back().trailer());
  ASSERT_TRUE(a.OnTrailer(t, mc.vocab_size).ok());
  EXPECT_EQ(t.first_token,
            static_cast<int32_t>(std::max_element(local->logits.begin(), local->logits.end()) -
                                 local->logits.begin()));
  EXPECT_EQ(t.full_cache_bytes, 300 * mc.KvBytesPerToken(model_->kv_dtype()));
  EXPECT_GT(t.forward_ms, 0);
  EXPECT_EQ(testing::CacheDifference(*local->cache, **cache), "");
}

TEST_F(PrefillServerTest, ChunksRespectTheRequestedBound) {
  Start();
  v1::PrefillRequest req = Request(200, CompressionConfig{});
  req.set_max_chunk_bytes(2048);
  const Reply r = Call(req);
  ASSERT_TRUE(r.status.ok());
  int chunks = 0;
  for (const auto& m : r.messages) {
    if (!m.has_chunk()) continue;
    ++chunks;
    EXPECT_LE(m.chunk().positions().size() + m.chunk().k().size() + m.chunk().v().size(), 2048u);
  }
  EXPECT_EQ(chunks, static_cast<int>(r.messages.back().trailer().chunks()));
  EXPECT_GT(chunks, model_->config().num_layers * model_->config().num_kv_heads);
}

// A decode cache of `layers` layers in pages of a device pool, as a cuda_ipc request names it.
v1::KvRegion IpcRegion(int layers) {
  v1::KvRegion r;
  r.set_ipc_handle("handle");
  r.set_bytes(1 << 20);
  r.set_page_bytes(4096);
  r.set_n_heads(1);
  r.set_head_dim(8);
  r.set_dtype(v1::KV_DTYPE_F32);
  for (int l = 0; l < layers; ++l) {
    r.add_capacity(16);
    r.add_page_tables()->add_pages(l);
  }
  return r;
}

TEST_F(PrefillServerTest, RefusesBadRequestsSayingWhy) {
  Start();
  struct Case {
    std::function<void(v1::PrefillRequest*)> edit;
    grpc::StatusCode code;
    std::string expect;
    std::string field = "";  // the PrefillRequest field its google.rpc.BadRequest names
  };
  const std::vector<Case> cases = {
      {[](auto* r) { r->set_model_fingerprint("llama-other"); },
       grpc::StatusCode::FAILED_PRECONDITION, "fingerprints differ"},
      {[](auto* r) { r->clear_model_fingerprint(); }, grpc::StatusCode::FAILED_PRECONDITION,
       "fingerprints differ"},
      {[](auto* r) { r->clear_prompt_ids(); }, grpc::StatusCode::INVALID_ARGUMENT, "empty",
       "prompt_ids"},
      {[](auto* r) { r->set_prompt_ids(2, 100000); }, grpc::StatusCode::INVALID_ARGUMENT,
       "prompt_ids[2]", "prompt_ids[2]"},
      {[](auto* r) { r->mutable_compression()->set_policy("nope"); },
       grpc::StatusCode::INVALID_ARGUMENT, "compression.policy", "compression.policy"},
      {[](auto* r) { r->set_max_chunk_bytes(10); }, grpc::StatusCode::INVALID_ARGUMENT,
       "max_chunk_bytes", "max_chunk_bytes"},
      {[](auto* r) { r->set_top_p(2); }, grpc::StatusCode::INVALID_ARGUMENT, "top_p", "top_p"},
      // Found with prefill_request_fuzz's inputs: the prefill node took temperatures the
      // decode node refuses (infinite, above 100).
      {[](auto* r) { r->set_temperature(std::numeric_limits<float>::infinity()); },
       grpc::StatusCode::INVALID_ARGUMENT, "temperature must be in [0, 100]", "temperature"},
      {[](auto* r) { r->set_temperature(101); }, grpc::StatusCode::INVALID_ARGUMENT,
       "temperature must be in [0, 100]", "temperature"},
      {[](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_budget(32);
         (*r->mutable_compression()->mutable_params())["budget"] = "8";
       },
       grpc::StatusCode::INVALID_ARGUMENT, "'budget' has a field of its own", "compression.params"},
      {[](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_budget(32);
         r->mutable_compression()->set_skip_layers(1000);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "skip_layers (1000) must be below the model's layer",
       "compression.skip_layers"},
      {[](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_budget(32);
         r->mutable_compression()->set_ratio(0.5);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "budget and ratio are both set", "compression.budget"},
      {[](auto* r) {
         for (int i = 0; i < 600; ++i) r->add_prompt_ids(5);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "context", "prompt_ids"},
      // Where a transport that writes the decode node's cache writes: every field checked, and
      // those of another transport refused.
      {[](auto* r) { *r->mutable_region() = IpcRegion(2); }, grpc::StatusCode::INVALID_ARGUMENT,
       "applies to the shm, cuda_ipc and nccl KV transports", "region"},
      {[](auto* r) { r->set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC); },
       grpc::StatusCode::INVALID_ARGUMENT, "needs the decode pool's slab", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->set_name("/kvwire-1-00");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "name applies to the shm transport", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->add_page_tables()->add_pages(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "3 page tables for 2 layers", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->set_page_bytes(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "pages of 0 bytes", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->set_side_offset(4096);  // a cache in its dtype has no coded state
       },
       grpc::StatusCode::INVALID_ARGUMENT, "side_offset applies to a coded cache", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_SHM);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->set_name("/kvwire-1-00");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "apply to the cuda_ipc and nccl transports", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->set_link_peer("decode-1");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "link_peer applies to the nccl transport", "region"},
      // nccl: the pages as on cuda_ipc, with the decode node's name instead of a handle.
      {[](auto* r) { r->set_kv_transport(v1::KV_TRANSPORT_NCCL); },
       grpc::StatusCode::INVALID_ARGUMENT, "needs the decode node's name", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_NCCL);
         *r->mutable_region() = IpcRegion(2);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "ipc_handle applies to the cuda_ipc transport",
       "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_NCCL);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->clear_ipc_handle();
       },
       grpc::StatusCode::INVALID_ARGUMENT, "link_peer '': nccl needs", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_NCCL);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->clear_ipc_handle();
         r->mutable_region()->set_link_peer("decode/../1");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "1 to 64 letters", "region"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_NCCL);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->clear_ipc_handle();
         r->mutable_region()->set_link_peer("decode-1");
         r->mutable_region()->add_capacity(16);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "2 page tables for 3 layers", "region"},
      {[](auto* r) { r->set_kv_transport(static_cast<v1::KvTransport>(9)); },
       grpc::StatusCode::INVALID_ARGUMENT, "unknown transport 9", "kv_transport"},
      // Well formed, to a node on the CPU: it does not serve cuda_ipc or nccl, and says how it
      // would.
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC);
         *r->mutable_region() = IpcRegion(2);
       },
       grpc::StatusCode::FAILED_PRECONDITION, "does not serve the cuda_ipc KV transport"},
      {[](auto* r) {
         r->set_kv_transport(v1::KV_TRANSPORT_NCCL);
         *r->mutable_region() = IpcRegion(2);
         r->mutable_region()->clear_ipc_handle();
         r->mutable_region()->set_link_peer("decode-1");
       },
       grpc::StatusCode::FAILED_PRECONDITION, "does not serve the nccl KV transport"},
  };
  for (const Case& c : cases) {
    v1::PrefillRequest req = Request(20, CompressionConfig{});
    c.edit(&req);
    const Reply r = Call(req);
    EXPECT_EQ(r.status.error_code(), c.code) << c.expect << ": " << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(c.expect), std::string::npos)
        << r.status.error_message();
    EXPECT_EQ(FieldOfDetails(r.status.error_details()).value_or(""), c.field) << c.expect;
    // Nothing tells a caller what the node would accept.
    EXPECT_EQ(r.status.error_message().find(model_->fingerprint()), std::string::npos)
        << r.status.error_message();
  }
  EXPECT_TRUE(Call(Request(20, CompressionConfig{})).status.ok());
}

TEST_F(PrefillServerTest, FullQueueIsResourceExhausted) {
  PrefillEngineOptions e;
  e.workers = 1;
  e.max_queue = 1;
  e.node_name = "busy";
  testing::FaultyPrefills::Plan hold;
  hold.hold_chunk = 0;  // every stream waits before its first chunk until released
  Start(e, hold);
  std::vector<Reply> replies(2);
  std::thread first([&] { replies[0] = Call(Request(30, CompressionConfig{})); });
  ASSERT_TRUE(faults_->WaitHeld(1));  // the worker is busy
  std::thread second([&] { replies[1] = Call(Request(30, CompressionConfig{})); });  // queued
  ASSERT_TRUE(faults_->WaitSubmitted(2));
  const Reply third = Call(Request(30, CompressionConfig{}));  // no room
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(third.status.error_message().find("prefill node busy is full"), std::string::npos)
      << third.status.error_message();
  faults_->Release();
  first.join();
  second.join();
  EXPECT_TRUE(replies[0].status.ok());
  EXPECT_TRUE(replies[1].status.ok());
}

// Fields a policy does not take are refused by name, not silently dropped.
TEST_F(PrefillServerTest, RefusesParametersOfAnotherPolicy) {
  Start();
  v1::PrefillRequest req = Request(40, CompressionConfig{});
  req.mutable_compression()->set_policy("snapkv_pp");
  req.mutable_compression()->set_budget(24);
  req.mutable_compression()->set_kernel(7);
  const Reply r = Call(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("compression.kernel does not apply to snapkv_pp"),
            std::string::npos)
      << r.status.error_message();
}

// A stream nobody reads holds the only worker until the send timeout, then is cancelled
// and the worker serves the next request.
TEST_F(PrefillServerTest, AStreamNobodyReadsIsCancelledAndFreesItsWorker) {
  PrefillEngineOptions e;
  e.workers = 1;
  PrefillServerOptions o;
  o.send_timeout = std::chrono::milliseconds(300);
  Start(e, {}, o);
  // The whole cache in 1 KiB chunks, far more than the transport takes for an idle reader.
  const int len = std::min(500, model_->config().context_limit() - 1);
  v1::PrefillRequest big = Request(len, CompressionConfig{});
  big.set_max_chunk_bytes(1024);
  // A reader whose transport takes 64 KiB ahead of it and no more (no window growth).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  auto idle_stub = v1::Prefill::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext idle;  // no deadline, as in the report
  auto reader = idle_stub->Prefill(&idle, big);
  v1::PrefillResponse first;
  ASSERT_TRUE(reader->Read(&first));  // the header; then the reader stops reading
  ASSERT_TRUE(first.has_header());

  const auto start = std::chrono::steady_clock::now();
  const Reply next = Call(Request(20, CompressionConfig{}));
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250))
      << "the worker was busy with the idle stream until its send timeout";
  // The idle stream was cancelled by the node: its reader sees the stream end.
  v1::PrefillResponse m;
  while (reader->Read(&m)) {
  }
  const grpc::Status st = reader->Finish();
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(m.has_trailer()) << "the idle stream never completed";
}

TEST_F(PrefillServerTest, ABearerTokenIsRequiredWhenSet) {
  PrefillServerOptions o;
  o.auth_token = "0123456789abcdef-secret";
  Start({}, {}, o);
  for (const std::string& wrong :
       {std::string(), std::string("Bearer nope"), std::string("Bearer 0123456789abcdef-secreT")}) {
    const Reply r = Call(Request(20, CompressionConfig{}), wrong);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << wrong;
    EXPECT_EQ(r.status.error_message(), "missing or wrong bearer token") << "nothing else told";
    EXPECT_TRUE(r.messages.empty());
  }
  // A bad request from an unauthenticated caller learns nothing about it either.
  v1::PrefillRequest other = Request(20, CompressionConfig{});
  other.set_model_fingerprint("llama-other");
  EXPECT_EQ(Call(other).status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Call(Request(20, CompressionConfig{}), "Bearer 0123456789abcdef-secret").status.ok());
}

TEST_F(PrefillServerTest, ServingAnyCallerOffLoopbackNeedsInsecure) {
  engine_ = std::make_unique<PrefillEngine>(model_.get(), PrefillEngineOptions{});
  PrefillServerOptions o;
  o.listen = "0.0.0.0:0";
  auto refused = PrefillServer::Start(engine_.get(), o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("--tls-client-ca"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("--insecure"), std::string::npos);
  o.insecure = true;
  auto allowed = PrefillServer::Start(engine_.get(), o);
  EXPECT_TRUE(allowed.ok()) << allowed.status();
  o.insecure = false;
  o.auth_token = "0123456789abcdef-secret";
  auto with_token = PrefillServer::Start(engine_.get(), o);
  EXPECT_TRUE(with_token.ok()) << with_token.status();
}

TEST_F(PrefillServerTest, RequestsOverTheSizeLimitAreRefused) {
  PrefillServerOptions o;
  o.max_request_bytes = 4096;
  Start({}, {}, o);
  v1::PrefillRequest big = Request(20, CompressionConfig{});
  big.set_request_id(std::string(5000, 'x'));
  const Reply r = Call(big);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << r.status.error_message();
  EXPECT_TRUE(Call(Request(20, CompressionConfig{})).status.ok());
}

TEST(ProtobufLogTest, LinesAreRateLimited) {
  google::protobuf::LogHandler* const before = google::protobuf::SetLogHandler(nullptr);
  LimitProtobufLogs();
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 3 * kProtobufLogBurst; ++i) GOOGLE_LOG(ERROR) << "invalid UTF-8 " << i;
  const std::string out = ::testing::internal::GetCapturedStderr();
  google::protobuf::SetLogHandler(before);
  int lines = 0;
  for (char c : out) lines += c == '\n';
  EXPECT_LE(lines, kProtobufLogBurst) << out;
  EXPECT_GE(lines, 1) << "the first lines pass";
}

}  // namespace
}  // namespace kvwire
