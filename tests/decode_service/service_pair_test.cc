// The service pair with real gRPC servers on loopback port 0: tokens through prefill node
// + decode node equal single-process generation; every bad request field is
// INVALID_ARGUMENT naming the field; a prefill node killed mid-stream, a client that
// cancels, a deadline that passes, a full pool and a corrupted KV chunk all end cleanly,
// after which the KV pool is empty again and the nodes keep serving.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <set>
#include <thread>

#include "common/engine/generate.h"
#include "common/telemetry/telemetry.h"
#include "decode_service/decode_server.h"
#include "decode_service/prefill_router.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "kernels/socket_link.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "prefill_service/prefill_server.h"
#include "tests/engine_fakes.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

using SteadyClock = std::chrono::steady_clock;
using Faults = testing::FaultyPrefills::Plan;

std::string ModelSpec() {
  return testing::SharedDir().empty() ? "synthetic:stories" : testing::StoriesModelDir();
}

struct Result {
  grpc::Status status;
  std::vector<int32_t> ids;
  std::string text;
  std::vector<float> logprobs;
  v1::Final final;
  int messages = 0;
  std::vector<int> tokens_per_message;  // of the messages with tokens
  std::vector<uint32_t> prompt_tokens;  // each message's (the first's is set)
};

Result Call(v1::Generation::Stub& stub, const v1::GenerateRequest& req, int deadline_ms = 30000,
            const std::function<void(grpc::ClientContext&, int)>& after_message = {}) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
  Result r;
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    ++r.messages;
    if (msg.token_ids_size() > 0) r.tokens_per_message.push_back(msg.token_ids_size());
    r.prompt_tokens.push_back(msg.prompt_tokens());
    r.ids.insert(r.ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    r.text += msg.text();
    r.logprobs.insert(r.logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    if (msg.has_final()) r.final = msg.final();
    if (after_message) after_message(ctx, r.messages);
  }
  r.status = reader->Finish();
  return r;
}

v1::GenerateRequest Request(const std::vector<int32_t>& ids, int max_tokens) {
  v1::GenerateRequest req;
  for (int32_t id : ids) req.mutable_prompt_ids()->add_ids(id);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  return req;
}

class ServicePairTest : public ::testing::Test {
 protected:
  void SetUp() override { LoadNodeModels({}); }
  // The models of the prefill and the decode node, on `options`' backend.
  void LoadNodeModels(const LoadOptions& options) {
    for (auto* m : {&prefill_model_, &decode_model_}) {
      auto model = LlamaModel::Load(ModelSpec(), options);
      ASSERT_TRUE(model.ok()) << model.status();
      *m = std::move(*model);
    }
  }
  void TearDown() override {
    for (auto& t : helpers_) t.join();
    decode_.reset();
    for (auto& p : prefills_) p->Release();
    prefills_.clear();
  }

  static std::unique_ptr<LlamaModel> Load() { return testing::LoadModel(ModelSpec()); }

  // A prefill node as the binary builds one (an engine and its gRPC server), with a fault
  // injector between them.
  struct PrefillNode {
    // Destroyed bottom up: the server, then the engine (its workers may still be in the
    // fault injector), then the injector.
    std::unique_ptr<testing::FaultyPrefills> faults;
    std::unique_ptr<PrefillEngine> engine;
    std::unique_ptr<PrefillServer> server;
    int port() const { return server->port(); }
    void Shutdown() { server->Shutdown(0); }
    void Release() { faults->Release(); }
  };

  // `model`: another model than the fixture's prefill model.
  PrefillNode* AddPrefill(const std::string& name = "prefill", Faults faults = {},
                          const std::string& listen = "127.0.0.1:0", LlamaModel* model = nullptr) {
    if (model == nullptr) model = prefill_model_.get();
    auto node = std::make_unique<PrefillNode>();
    PrefillEngineOptions e;
    e.node_name = name;
    e.prefix_cache_bytes = prefix_cache_bytes_;
    e.prefix_block_tokens = 16;
    e.max_queue = prefill_max_queue_;
    node->engine = std::make_unique<PrefillEngine>(model, e);
    node->faults = std::make_unique<testing::FaultyPrefills>(node->engine.get(), faults);
    PrefillServerOptions o;
    o.listen = listen;
    o.serve_shm = serve_shm_;
    if (transport_ == KvTransport::kCudaIpc || serve_cuda_ipc_) {
      o.device = prefill_model_->backend();
    }
    if (transport_ == KvTransport::kNccl || serve_nccl_) o.links = prefill_model_->backend();
    o.backend = model->backend();
    o.node_name = name;
    auto s = PrefillServer::Start(node->faults.get(), std::move(o));
    EXPECT_TRUE(s.ok()) << s.status();
    node->server = std::move(*s);
    prefills_.push_back(std::move(node));
    return prefills_.back().get();
  }

  void StartDecode(DecodeServerOptions o = {}) {
    o.listen = "127.0.0.1:0";
    if (o.prefill_target.empty() && !prefills_.empty()) o.prefill_target = PrefillTarget();
    o.engine.node_name = "decode-test";
    if (o.kv_transport == KvTransport::kGrpc) o.kv_transport = transport_;
    if (o.kv_transport == KvTransport::kShm &&
        o.kv_pool_bytes == DecodeServerOptions{}.kv_pool_bytes) {
      // Every cache is a region in /dev/shm, which a container may keep small (64 MiB).
      o.kv_pool_bytes = size_t{32} << 20;
    }
    if (o.kv_transport == KvTransport::kCudaIpc) {
      // A failed attempt's pages wait out its deadline (the prefill node's lease) before they
      // return to the pool: short here, so that ExpectPoolEmpty sees them come back.
      o.engine.prefill_attempt_timeout_ms = kIpcAttemptMs;
    }
    auto s = DecodeServer::Start(decode_model_.get(), std::move(o));
    ASSERT_TRUE(s.ok()) << s.status();
    decode_ = std::move(*s);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(decode_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Generation::NewStub(channel_);
    // Under CI's load a fresh channel's first connect to the node just started failed once
    // (UNAVAILABLE, with an errno no connect gives), failing the test's first call; the
    // channel tries again after its backoff, so the tests start once it is connected.
    ASSERT_TRUE(
        channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)))
        << "no connection to the decode node on port " << decode_->port() << " in 10 s";
  }

  // Every prefill node, as the decode node's --prefill names them.
  std::string PrefillTarget() const {
    std::string target = "ipv4:";
    for (size_t i = 0; i < prefills_.size(); ++i) {
      target += (i ? ",127.0.0.1:" : "127.0.0.1:") + std::to_string(prefills_[i]->port());
    }
    return target;
  }
  // Prompts (a 1, then a `length`-token document) whose leading 16 tokens a router over the
  // prefill nodes maps to `node`: the first `count` of 400 candidates, which `salt` varies.
  std::vector<std::vector<int32_t>> DocumentsRoutedTo(const PrefillNode* node, int count,
                                                      int length = 40, int salt = 0) const {
    std::vector<std::vector<int32_t>> out;
    auto router = PrefillRouter::Create(PrefillTarget(), 16, [](const std::string& a) {
      return grpc::CreateChannel(a, grpc::InsecureChannelCredentials());
    });
    EXPECT_TRUE(router.ok()) << router.status();
    const std::string address = "ipv4:127.0.0.1:" + std::to_string(node->port());
    for (int doc = 0; router.ok() && doc < 400 && static_cast<int>(out.size()) < count; ++doc) {
      std::vector<int32_t> ids = {1};
      for (int t = 0; t < length; ++t) ids.push_back(3 + (doc * 131 + t * 7 + salt) % 400);
      if ((*router)->Route((*router)->Key(ids), 0).node == address) out.push_back(std::move(ids));
    }
    EXPECT_EQ(static_cast<int>(out.size()), count) << "documents of 400 that map to " << address;
    return out;
  }
  std::vector<int32_t> DocumentRoutedTo(const PrefillNode* node) const {
    auto docs = DocumentsRoutedTo(node, 1);
    return docs.empty() ? std::vector<int32_t>{} : docs[0];
  }

  // The pool is empty again (waits a little: pages return when the engine notices).
  void ExpectPoolEmpty() {
    const auto until =
        SteadyClock::now() + std::chrono::seconds(5) +
        (transport_ == KvTransport::kCudaIpc ? std::chrono::milliseconds(kIpcAttemptMs + 1000)
                                             : std::chrono::milliseconds(0));
    while (decode_->pool().used() != 0 && SteadyClock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(decode_->pool().used(), 0u);
    EXPECT_EQ(decode_->engine().active(), 0);
  }

  // A request the nodes must still serve correctly.
  void ExpectStillServing() {
    v1::GenerateRequest req;
    req.mutable_prompt_ids()->add_ids(1);
    req.mutable_sampling()->set_max_tokens(4);
    const Result r = Call(*stub_, req);
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.ids.size(), 4u);
  }

  // Shuts `node` down (on a helper thread) once a stream is held in its fault injector and
  // `settle` has passed: time for the chunks before the held one to reach the decode node,
  // which counts an attempt as one only once its stream's header arrived (a stream cut
  // before that looks like a node that could not be reached).
  void ShutDownWhenHeld(PrefillNode* node,
                        std::chrono::milliseconds settle = std::chrono::milliseconds(0)) {
    helpers_.emplace_back([node, settle] {
      if (node->faults->WaitHeld()) {
        std::this_thread::sleep_for(settle);
        node->Shutdown();
      }
    });
  }

  std::vector<int32_t> LongPrompt(int n) const {
    std::vector<int32_t> ids = {1};
    auto text = decode_model_->tokenizer().Encode(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
        "park with her friends and her dog. One day, she saw a big red ball under a tree. ",
        false);
    while (static_cast<int>(ids.size()) < n) {
      for (int32_t id : *text) {
        if (static_cast<int>(ids.size()) < n) ids.push_back(id);
      }
    }
    return ids;
  }

  // Tokens through the pair (prefill node, then decode node over gRPC) equal `reference`'s
  // single-process generation for each compression, greedy and sampled; logprobs within
  // `logprob_tol`.
  void ExpectTokensEqualSingleProcess(LlamaModel& reference, double logprob_tol) {
    AddPrefill();
    StartDecode();
    const std::vector<int32_t> prompt = LongPrompt(300);
    struct Case {
      std::string name;
      std::function<void(v1::CompressionParams*)> compression;
      std::string policy;
      int budget;
      ParamValues params = {};
    };
    const std::vector<Case> cases = {
        {"full", [](auto* c) { c->set_policy("full"); }, "full", 0},
        {"snapkv",
         [](auto* c) {
           c->set_policy("snapkv");
           c->set_budget(64);
         },
         "snapkv", 64},
        {"snapkv per query head",
         [](auto* c) {
           c->set_policy("snapkv");
           c->set_budget(48);
           c->set_gqa("per_query_head");
         },
         "snapkv",
         48,
         {{"gqa", "per_query_head"}}},
        {"chunkkv",
         [](auto* c) {
           c->set_policy("chunkkv");
           c->set_budget(80);
         },
         "chunkkv", 80},
    };
    for (const Case& c : cases) {
      for (bool sampled : {false, true}) {
        SCOPED_TRACE(c.name + (sampled ? " sampled" : " greedy"));
        v1::GenerateRequest req = Request(prompt, 24);
        c.compression(req.mutable_compression());
        req.set_return_logprobs(true);
        GenerationRequest local;
        local.prompt_ids = prompt;
        local.max_tokens = 24;
        local.compression.policy = *MakePolicy(c.policy, c.params);
        local.compression.budget = c.budget;
        local.stop_ids = decode_model_->config().eos_token_ids;
        if (sampled) {
          req.mutable_sampling()->set_temperature(0.8f);
          req.mutable_sampling()->set_top_p(0.9f);
          req.mutable_sampling()->set_seed(7);
          local.sampling = {0.8f, 0, 0.9f};
          local.seed = 7;
        } else {
          local.sampling.temperature = 0;
        }
        const Result r = Call(*stub_, req);
        ASSERT_TRUE(r.status.ok()) << r.status.error_message();
        auto want = Generate(reference, local);
        ASSERT_TRUE(want.ok()) << want.status();
        EXPECT_EQ(r.ids, want->ids);
        ASSERT_EQ(r.logprobs.size(), want->logprobs.size());
        for (size_t i = 0; i < r.logprobs.size(); ++i)
          EXPECT_NEAR(r.logprobs[i], want->logprobs[i], logprob_tol);
        auto text = decode_model_->tokenizer().Decode(want->ids);
        StreamingDecoder expect_text(decode_model_->tokenizer());
        ASSERT_TRUE(expect_text.Prime(prompt).ok());
        std::string streamed;
        for (int32_t id : want->ids) streamed += *expect_text.Push(id);
        streamed += expect_text.Flush();
        EXPECT_EQ(r.text, streamed);
        // The request's own figures.
        const v1::RequestStats& st = r.final.stats();
        const int64_t per_token =
            decode_model_->config().KvBytesPerToken(decode_model_->kv_dtype());
        EXPECT_EQ(r.final.usage().prompt_tokens(), 300);
        EXPECT_EQ(r.final.usage().completion_tokens(), static_cast<int>(want->ids.size()));
        EXPECT_EQ(st.full_cache_bytes(), 300 * per_token);
        EXPECT_EQ(st.kept_tokens(), c.budget ? c.budget : 300);
        EXPECT_GT(st.wire_bytes(), 0);
        if (c.policy != "full") {
          EXPECT_LT(st.wire_bytes(), st.full_cache_bytes());
        }
        EXPECT_EQ(st.prefill_node(), "prefill");
        EXPECT_EQ(st.decode_node(), "decode-test");
        EXPECT_GT(st.ttft_ms(), 0);
        EXPECT_EQ(st.prefill_attempts(), 1);
      }
    }
    ExpectPoolEmpty();
  }

  // The same request through grpc and through `t`, each on a decode node of its own: the same
  // tokens, and the same K/V payload (what the chunks carry on grpc, and stand for on `t`),
  // with the rows placed counted once among the bytes moved.
  void ExpectTransportsMoveTheSame(KvTransport t, const std::string& format) {
    std::vector<Result> by_transport;
    for (KvTransport each : {KvTransport::kGrpc, t}) {
      decode_.reset();
      DecodeServerOptions o;
      o.kv_transport = each;
      StartDecode(o);
      v1::GenerateRequest req = Request(LongPrompt(260), 12);
      req.mutable_compression()->set_policy("snapkv");
      req.mutable_compression()->set_budget(64);
      req.mutable_compression()->set_kv_format(format);
      by_transport.push_back(Call(*stub_, req));
      ASSERT_TRUE(by_transport.back().status.ok()) << by_transport.back().status.error_message();
      ExpectPoolEmpty();
    }
    EXPECT_EQ(by_transport[0].ids, by_transport[1].ids);
    EXPECT_EQ(by_transport[0].final.stats().kv_payload_bytes(),
              by_transport[1].final.stats().kv_payload_bytes());
    EXPECT_GT(by_transport[1].final.stats().wire_bytes(),
              by_transport[1].final.stats().kv_payload_bytes());
  }

  // A decode node asking for `t` from prefill nodes that do not serve it: the request fails
  // with FAILED_PRECONDITION saying `says` (how to serve it), and the pool is whole again.
  void ExpectRefusedSaying(KvTransport t, const std::string& says) {
    DecodeServerOptions o;
    o.kv_transport = t;
    o.engine.prefill_attempts = 1;
    StartDecode(o);
    const Result r = Call(*stub_, Request(LongPrompt(50), 4));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(says), std::string::npos) << r.status.error_message();
    ExpectPoolEmpty();
  }

  static constexpr int kIpcAttemptMs = 4000;
  // Whether /dev/shm holds a shm test's caches (StartDecode's pool), which a container may not.
  static bool ShmFits() { return SharedRegionRoom().value_or(0) >= (size_t{32} << 20); }
  static constexpr char kNoShm[] = "/dev/shm has less than 32 MiB free for the shm caches";
  // How the decode node asks for K/V; whether the prefill nodes serve shm (as a node started
  // with --kv-transport grpc,shm).
  KvTransport transport_ = KvTransport::kGrpc;
  bool serve_shm_ = true;
  bool serve_cuda_ipc_ = false;    // the prefill nodes serve cuda_ipc (on a device backend)
  bool serve_nccl_ = false;        // ... and nccl
  size_t prefix_cache_bytes_ = 0;  // the prefill nodes' prefix caches (blocks of 16 tokens)
  int prefill_max_queue_ = 16;     // prefills that may wait on a prefill node
  std::unique_ptr<LlamaModel> prefill_model_, decode_model_;
  std::vector<std::unique_ptr<LlamaModel>> other_models_;  // of prefill nodes given their own
  std::vector<std::unique_ptr<PrefillNode>> prefills_;
  std::unique_ptr<DecodeServer> decode_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  std::vector<std::thread> helpers_;  // joined before the servers go
};

// The tests that hold for every KV transport, run on each: grpc (the rows in the stream's
// chunks), shm (written by the prefill node into the decode node's cache, a shared region) and
// cuda_ipc (written into the pages of the decode node's device pool, mapped by the prefill
// node's backend: both nodes on the guarded backend here, whose export and import emulate CUDA
// IPC; on a GPU the cluster test runs it between two processes).
class ServicePairTransport : public ServicePairTest,
                             public ::testing::WithParamInterface<KvTransport> {
 protected:
  void SetUp() override {
    transport_ = GetParam();
    if (transport_ == KvTransport::kShm && !ShmFits()) GTEST_SKIP() << kNoShm;
    if (transport_ == KvTransport::kCudaIpc || transport_ == KvTransport::kNccl) {
      LoadOptions o;
      o.backend = kernels::BackendKind::kGuarded;
      LoadNodeModels(o);
      return;
    }
    ServicePairTest::SetUp();
  }
};

INSTANTIATE_TEST_SUITE_P(Transports, ServicePairTransport,
                         ::testing::Values(KvTransport::kGrpc, KvTransport::kShm,
                                           KvTransport::kCudaIpc, KvTransport::kNccl),
                         [](const auto& info) { return std::string(KvTransportName(info.param)); });

TEST_P(ServicePairTransport, TokensEqualSingleProcessGeneration) {
  ExpectTokensEqualSingleProcess(*decode_model_, 1e-4);
}

// The same request through grpc and through shm: the same tokens, and the same K/V payload
// (what the chunks carry on grpc, and stand for on shm).
TEST_F(ServicePairTest, ShmMovesWhatGrpcMoves) {
  if (!ShmFits()) GTEST_SKIP() << kNoShm;
  AddPrefill();
  ExpectTransportsMoveTheSame(KvTransport::kShm, "int4");
}

// cuda_ipc against grpc, both nodes on the guarded backend (whose export and import emulate CUDA
// IPC): the same tokens and K/V payload, the rows written into the decode node's pool pages.
TEST_F(ServicePairTest, CudaIpcMovesWhatGrpcMoves) {
  LoadOptions device;
  device.backend = kernels::BackendKind::kGuarded;
  LoadNodeModels(device);
  serve_cuda_ipc_ = true;
  AddPrefill();
  for (const char* format : {"auto", "int4"}) {
    SCOPED_TRACE(format);
    ExpectTransportsMoveTheSame(KvTransport::kCudaIpc, format);
  }
}

// nccl against grpc, both nodes on the guarded backend (whose links emulate NCCL over a
// loopback socket): the same tokens and K/V payload, the rows received into the decode node's
// pool pages. Then requests at once on the last decode node, which share the prefill node's
// links (one stream each at a time, kept warm between them).
TEST_F(ServicePairTest, NcclMovesWhatGrpcMoves) {
  LoadOptions device;
  device.backend = kernels::BackendKind::kGuarded;
  LoadNodeModels(device);
  serve_nccl_ = true;
  AddPrefill();
  for (const char* format : {"auto", "int4", "fp8"}) {
    SCOPED_TRACE(format);
    ExpectTransportsMoveTheSame(KvTransport::kNccl, format);
  }
  const std::vector<int32_t> want = Call(*stub_, Request(LongPrompt(200), 6)).ids;
  ASSERT_EQ(want.size(), 6u);
  // The links' receives slowed, as over a slow fabric: the prefill node's later streams on a
  // link reach the decode node before the first has finished, and their chunks wait for their
  // turn, which must not take the threads gRPC runs the first stream's reads on (the decode
  // node's receives once did, and the three streams hung until their deadline).
  kernels::SetSocketLinkReceiveDelay(std::chrono::milliseconds(20));
  struct NoDelay {
    ~NoDelay() { kernels::SetSocketLinkReceiveDelay(std::chrono::milliseconds(0)); }
  } no_delay;
  std::vector<std::thread> calls;
  std::vector<Result> got(6);
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 3; ++i) {
      calls.emplace_back(
          [&, i, round] { got[3 * round + i] = Call(*stub_, Request(LongPrompt(200), 6)); });
    }
    for (auto& t : calls) t.join();
    calls.clear();
  }
  for (const Result& r : got) {
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.ids, want);
  }
  ExpectPoolEmpty();
}

// cuda_ipc and nccl need a device pool on the decode node and a device prefill node that serves
// them; each refusal says what to change.
TEST_F(ServicePairTest, DeviceTransportsRefusedWhereTheyCannotRun) {
  for (KvTransport t : {KvTransport::kCudaIpc, KvTransport::kNccl}) {
    const std::string name(KvTransportName(t));
    SCOPED_TRACE(name);
    decode_.reset();
    prefills_.clear();
    LoadNodeModels(LoadOptions{});
    AddPrefill();  // a CPU prefill node, which serves grpc and shm only
    DecodeServerOptions host;
    host.kv_transport = t;
    host.listen = "127.0.0.1:0";
    host.prefill_target = "127.0.0.1:" + std::to_string(prefills_[0]->port());
    auto refused = DecodeServer::Start(decode_model_.get(), host);  // a host pool
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find("--backend cuda"), std::string::npos)
        << refused.status();
    LoadOptions device;
    device.backend = kernels::BackendKind::kGuarded;
    LoadNodeModels(device);
    prefills_.clear();
    AddPrefill();
    ExpectRefusedSaying(t, "does not serve the " + name);
    // And a prefill node on a host backend cannot serve it at all.
    PrefillServerOptions p;
    p.listen = "127.0.0.1:0";
    (t == KvTransport::kCudaIpc ? p.device : p.links) = Load()->backend();
    auto engine = std::make_unique<PrefillEngine>(prefill_model_.get(), PrefillEngineOptions{});
    auto server = PrefillServer::Start(engine.get(), p);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition) << server.status();
  }
}

// The prefix cache through the pair: the second question on a document reads the document's
// blocks from the prefill node's cache (cached_tokens in the stats), and generates what a node
// without a cache does; every policy, and a prompt that shares part of a block.
TEST_F(ServicePairTest, APrefixCachedOnThePrefillNodeGivesTheSameTokens) {
  AddPrefill("plain");
  prefix_cache_bytes_ = size_t{16} << 20;
  AddPrefill("cached");
  std::vector<std::unique_ptr<DecodeServer>> decodes;
  auto stub_to = [&](int prefill) {
    DecodeServerOptions o;
    o.listen = "127.0.0.1:0";
    o.prefill_target = "127.0.0.1:" + std::to_string(prefills_[prefill]->port());
    o.engine.local_prefill_below = 0;
    auto d = DecodeServer::Start(decode_model_.get(), o);
    EXPECT_TRUE(d.ok()) << d.status();
    decodes.push_back(std::move(*d));
    return v1::Generation::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(decodes.back()->port()), grpc::InsecureChannelCredentials()));
  };
  auto plain = stub_to(0), cached = stub_to(1);
  const std::vector<int32_t> document = LongPrompt(160);
  int i = 0;
  for (const char* policy : {"snapkv", "full", "chunkkv", "hbw"}) {
    for (int question = 0; question < 3; ++question, ++i) {
      SCOPED_TRACE(absl::StrCat(policy, " question ", question));
      std::vector<int32_t> ids = document;
      // The third question cuts into the document's last block.
      if (question == 2) ids.resize(150);
      for (int t = 0; t < 6; ++t) ids.push_back(5 + (question * 7 + t) % 40);
      v1::GenerateRequest req = Request(ids, 8);
      req.mutable_compression()->set_policy(policy);
      if (std::string(policy) != "full") req.mutable_compression()->set_budget(48);
      const Result want = Call(*plain, req), got = Call(*cached, req);
      ASSERT_TRUE(want.status.ok()) << want.status.error_message();
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      EXPECT_EQ(got.ids, want.ids);
      EXPECT_EQ(got.final.stats().kept_tokens(), want.final.stats().kept_tokens());
      EXPECT_EQ(want.final.stats().cached_tokens(), 0);
      if (i == 0) {
        EXPECT_EQ(got.final.stats().cached_tokens(), 0);  // the first fills the cache
      } else {
        EXPECT_GE(got.final.stats().cached_tokens(), question == 2 ? 96 : 128);
      }
    }
  }
}

// Affinity routing: a decode node that routes by the prompt's leading tokens sends every
// question on a document to one prefill node, whose prefix cache then holds the document, and
// spreads documents over the nodes; round robin finds the document cached less often. A dead
// preferred node: the retry takes the next node on the ring.
TEST_F(ServicePairTest, AffinityRoutingSendsADocumentsQuestionsToOneNode) {
  prefix_cache_bytes_ = size_t{16} << 20;
  PrefillNode* p0 = AddPrefill("p0");
  PrefillNode* p1 = AddPrefill("p1");
  // The ring hangs on the nodes' addresses, whose ports differ from run to run: the documents
  // are chosen three on one node's arc and four on the other's, so that the run cannot depend on
  // how the ports split seven fixed documents (all on one node about one run in fifty).
  std::vector<std::vector<int32_t>> documents = DocumentsRoutedTo(p0, 3, 90, 16);
  for (auto& d : DocumentsRoutedTo(p1, 4, 90, 16)) documents.push_back(std::move(d));
  ASSERT_EQ(documents.size(), 7u);
  auto run = [&](int affinity_tokens, std::map<int, std::set<std::string>>* nodes) {
    decode_.reset();
    DecodeServerOptions o;
    o.prefill_affinity_tokens = affinity_tokens;
    o.engine.local_prefill_below = 0;
    StartDecode(o);
    int hits = 0;
    for (int question = 0; question < 4; ++question) {
      for (int doc = 0; doc < 7; ++doc) {
        // Round robin's documents differ from affinity's: none is cached from the first run.
        std::vector<int32_t> ids = documents[doc];
        if (affinity_tokens == 0) {
          for (size_t t = 1; t < ids.size(); ++t) ids[t] = 3 + (ids[t] - 3 + 1) % 400;
        }
        for (int t = 0; t < 5; ++t) ids.push_back(3 + (question * 11 + t) % 400);
        const Result r = Call(*stub_, Request(ids, 2));
        EXPECT_TRUE(r.status.ok()) << r.status.error_message();
        (*nodes)[doc].insert(r.final.stats().prefill_node());
        hits += r.final.stats().cached_tokens() > 0;
      }
    }
    return hits;
  };
  std::map<int, std::set<std::string>> by_affinity, by_round_robin;
  const int affinity_hits = run(16, &by_affinity);
  const int round_robin_hits = run(0, &by_round_robin);
  for (const auto& [doc, nodes] : by_affinity) {
    ASSERT_EQ(nodes.size(), 1u) << "document " << doc;
    EXPECT_EQ(*nodes.begin(), doc < 3 ? "p0" : "p1") << "document " << doc;
  }
  EXPECT_EQ(affinity_hits, 3 * 7);  // every question after a document's first
  EXPECT_LT(round_robin_hits, affinity_hits);
  // The node a document maps to goes away: its questions are answered by the other.
  p0->Shutdown();
  decode_.reset();
  DecodeServerOptions o;
  o.prefill_affinity_tokens = 16;
  o.engine.local_prefill_below = 0;
  StartDecode(o);
  std::vector<int32_t> ids = documents[0];
  ids.push_back(9);
  const Result r = Call(*stub_, Request(ids, 2));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.final.stats().prefill_node(), "p1");
}

// The node a document maps to is full (its worker busy, its queue at --max-queue): the
// question it refuses goes to the least loaded other node, and the decode node's metrics count
// the affinity picks and the fallback.
TEST_F(ServicePairTest, AffinityFallsBackToTheLeastLoadedNodeWhenThePreferredIsFull) {
  prefix_cache_bytes_ = size_t{16} << 20;
  prefill_max_queue_ = 1;
  PrefillNode* busy = AddPrefill("p0", {.hold_chunk = 0});
  AddPrefill("p1");
  AddPrefill("p2");
  auto telemetry = Telemetry::Create({"decode", "d", "", ""});
  ASSERT_TRUE(telemetry.ok()) << telemetry.status();
  DecodeServerOptions o;
  o.prefill_affinity_tokens = 16;
  o.engine.local_prefill_below = 0;
  o.telemetry = telemetry->get();
  StartDecode(o);
  const std::vector<int32_t> document = DocumentRoutedTo(busy);
  ASSERT_FALSE(document.empty());
  auto question = [&](int q) {
    std::vector<int32_t> ids = document;
    for (int t = 0; t < 5; ++t) ids.push_back(3 + (q * 11 + t) % 400);
    return Request(ids, 2);
  };
  // The first question runs on p0 and is held there; the second waits in its queue.
  Result first, second;
  helpers_.emplace_back([&] { first = Call(*stub_, question(0)); });
  ASSERT_TRUE(busy->faults->WaitHeld(1));
  helpers_.emplace_back([&] { second = Call(*stub_, question(1)); });
  ASSERT_TRUE(busy->faults->WaitSubmitted(2));
  // The third is refused by p0 and answered by p1 or p2, whichever has less in flight (both
  // none): the first of them on the ring.
  const Result third = Call(*stub_, question(2));
  ASSERT_TRUE(third.status.ok()) << third.status.error_message();
  EXPECT_NE(third.final.stats().prefill_node(), "p0");
  EXPECT_GE(third.final.stats().prefill_attempts(), 1);
  busy->Release();
  for (auto& t : helpers_) t.join();
  helpers_.clear();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(first.final.stats().prefill_node(), "p0");
  EXPECT_EQ(second.final.stats().prefill_node(), "p0");
  EXPECT_GT(second.final.stats().cached_tokens(), 0);  // the document, from the first
  const std::string metrics = (*telemetry)->Scrape();
  EXPECT_NE(
      metrics.find("kvwire_prefill_routes_total{node=\"d\",role=\"decode\",route=\"affinity\"} 3"),
      std::string::npos)
      << metrics;
  EXPECT_NE(
      metrics.find("kvwire_prefill_routes_total{node=\"d\",role=\"decode\",route=\"fallback\"} 1"),
      std::string::npos)
      << metrics;
  decode_.reset();  // before the telemetry it reports to
}

// Two prefill nodes of different models behind one decode node (a deployment mistake): the
// node of the other model refuses the decode node's prompts before computing anything, saying
// the fingerprints differ, so its prefix cache never holds them; the node of the decode node's
// model serves and caches them.
TEST_F(ServicePairTest, APrefillNodeOfAnotherModelRefusesAndCachesNothing) {
  prefix_cache_bytes_ = size_t{16} << 20;
  auto other = LlamaModel::Load("synthetic:stories,seed=7", {});
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_NE((*other)->fingerprint(), prefill_model_->fingerprint());
  other_models_.push_back(*std::move(other));
  PrefillNode* same = AddPrefill("p-same");
  PrefillNode* differs = AddPrefill("p-other", {}, "127.0.0.1:0", other_models_.back().get());
  DecodeServerOptions o;
  o.prefill_affinity_tokens = 16;
  o.engine.local_prefill_below = 0;
  StartDecode(o);
  const std::vector<int32_t> ours = DocumentRoutedTo(same), theirs = DocumentRoutedTo(differs);
  ASSERT_FALSE(ours.empty() || theirs.empty());
  for (int question = 0; question < 2; ++question) {
    std::vector<int32_t> ids = ours;
    for (int t = 0; t < 5; ++t) ids.push_back(3 + (question * 11 + t) % 400);
    const Result r = Call(*stub_, Request(ids, 2));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.final.stats().prefill_node(), "p-same");
    EXPECT_EQ(r.final.stats().cached_tokens() > 0, question == 1);
  }
  const Result refused = Call(*stub_, Request(theirs, 2));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.status.error_message().find("fingerprints differ"), std::string::npos)
      << refused.status.error_message();
  EXPECT_EQ(differs->engine->prefix_cache()->counters().blocks, 0);
  EXPECT_GT(same->engine->prefix_cache()->counters().blocks, 0);
  // Its own model's documents are still served (a prompt the ring maps to p-other is not).
  const Result again = Call(*stub_, Request(ours, 2));
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
}

// A prefill node that does not serve shm refuses it, saying how to; the decode node reports it.
TEST_F(ServicePairTest, ShmRefusedByANodeThatDoesNotServeIt) {
  if (!ShmFits()) GTEST_SKIP() << kNoShm;
  serve_shm_ = false;
  AddPrefill();
  ExpectRefusedSaying(KvTransport::kShm, "--kv-transport grpc,shm");
}

// Both nodes on a device backend (guarded everywhere; cuda where a GPU is present): the pair's
// tokens equal the CPU engine's single-process generation.
class ServicePairOnDevice : public ServicePairTest,
                            public ::testing::WithParamInterface<kernels::BackendKind> {
 protected:
  void SetUp() override {
    if (GetParam() == kernels::BackendKind::kCuda && !kernels::CudaAvailable()) {
      GTEST_SKIP() << "no GPU: the pair on cuda runs where one is present (scripts/device_run.sh)";
    }
    LoadOptions o;
    o.backend = GetParam();
    LoadNodeModels(o);
    cpu_model_ = Load();
    ASSERT_NE(cpu_model_, nullptr);
  }
  std::unique_ptr<LlamaModel> cpu_model_;
};

TEST_P(ServicePairOnDevice, TokensEqualTheCpuEngine) {
  // The GPU sums in other orders (and on tensor cores): logprobs agree to 1e-3 there.
  ExpectTokensEqualSingleProcess(*cpu_model_,
                                 GetParam() == kernels::BackendKind::kCuda ? 1e-3 : 1e-4);
}

// A prompt prefilled on the decode node itself (its local prefill, on its own worker thread)
// into the device pool: the same tokens as the CPU engine's.
TEST_P(ServicePairOnDevice, LocalPrefillEqualsTheCpuEngine) {
  AddPrefill();
  DecodeServerOptions o;
  o.engine.local_prefill_below = 1000;
  StartDecode(o);
  for (int budget : {0, 64}) {
    SCOPED_TRACE(budget);
    v1::GenerateRequest req = Request(LongPrompt(300), 16);
    req.mutable_compression()->set_policy(budget ? "snapkv" : "full");
    if (budget) req.mutable_compression()->set_budget(budget);
    const Result r = Call(*stub_, req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.final.stats().prefill_node(), "local");
    GenerationRequest local;
    local.prompt_ids = LongPrompt(300);
    local.max_tokens = 16;
    local.sampling.temperature = 0;
    local.compression.policy = *MakePolicy(budget ? "snapkv" : "full");
    local.compression.budget = budget;
    local.stop_ids = decode_model_->config().eos_token_ids;
    auto want = Generate(*cpu_model_, local);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(r.ids, want->ids);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ServicePairOnDevice,
                         ::testing::Values(kernels::BackendKind::kGuarded,
                                           kernels::BackendKind::kCuda),
                         [](const auto& info) {
                           return std::string(kernels::BackendName(info.param));
                         });

TEST_F(ServicePairTest, ConcurrentRequestsShareTheBatch) {
  AddPrefill();
  DecodeServerOptions o;
  o.default_compression.policy = *MakePolicy("snapkv");
  o.default_compression.budget = 40;
  StartDecode(o);
  constexpr int kRequests = 8;
  std::vector<Result> results(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest req = Request(LongPrompt(60 + 17 * i), 12 + i);
      results[i] = Call(*stub_, req);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    GenerationRequest local;
    local.prompt_ids = LongPrompt(60 + 17 * i);
    local.max_tokens = 12 + i;
    local.sampling.temperature = 0;
    local.compression.policy = *MakePolicy("snapkv");
    local.compression.budget = 40;
    local.stop_ids = decode_model_->config().eos_token_ids;
    auto want = Generate(*decode_model_, local);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(results[i].ids, want->ids) << "request " << i;
  }
  ExpectPoolEmpty();
}

TEST_F(ServicePairTest, LocalPrefillForShortPrompts) {
  AddPrefill();
  DecodeServerOptions o;
  o.engine.local_prefill_below = 50;
  StartDecode(o);
  const Result r = Call(*stub_, Request(LongPrompt(20), 10));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.final.stats().prefill_node(), "local");
  EXPECT_EQ(r.final.stats().wire_bytes(), 0);
  GenerationRequest local;
  local.prompt_ids = LongPrompt(20);
  local.max_tokens = 10;
  local.sampling.temperature = 0;
  local.stop_ids = decode_model_->config().eos_token_ids;
  EXPECT_EQ(r.ids, Generate(*decode_model_, local)->ids);
  const Result remote = Call(*stub_, Request(LongPrompt(80), 4));
  ASSERT_TRUE(remote.status.ok());
  EXPECT_EQ(remote.final.stats().prefill_node(), "prefill");
}

TEST_F(ServicePairTest, TextPromptStopStringsAndEos) {
  AddPrefill();
  StartDecode();
  v1::GenerateRequest req;
  req.set_prompt("Once upon a time, there was a little girl named Lily.");
  req.mutable_sampling()->set_max_tokens(48);
  const Result full = Call(*stub_, req);
  ASSERT_TRUE(full.status.ok());
  ASSERT_GT(full.text.size(), 20u);
  // Stop at a string from the middle of that text: output ends right before it.
  const std::string stop = full.text.substr(full.text.size() / 2, 4);
  req.mutable_sampling()->add_stop(stop);
  const Result stopped = Call(*stub_, req);
  ASSERT_TRUE(stopped.status.ok());
  EXPECT_EQ(stopped.final.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(stopped.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(full.final.finish_reason(), v1::FINISH_REASON_LENGTH);
  // A stop token id ends generation after that token.
  v1::GenerateRequest by_id = req;
  by_id.mutable_sampling()->clear_stop();
  by_id.mutable_sampling()->add_stop_token_ids(full.ids[3]);
  const Result r = Call(*stub_, by_id);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.ids, std::vector<int32_t>(full.ids.begin(), full.ids.begin() + 4));
  EXPECT_EQ(r.final.finish_reason(), v1::FINISH_REASON_STOP);
}

TEST_F(ServicePairTest, EveryBadFieldIsInvalidArgumentNamingIt) {
  AddPrefill();
  StartDecode();
  struct Case {
    std::string expect;
    std::function<void(v1::GenerateRequest*)> edit;
  };
  const int vocab = decode_model_->config().vocab_size;
  const int head_dim = decode_model_->config().head_dim;
  const std::vector<Case> cases = {
      {"input", [](auto* r) { r->clear_prompt_ids(); }},
      {"prompt: is empty", [](auto* r) { r->set_prompt(""); }},
      {"prompt_ids: is empty", [](auto* r) { r->mutable_prompt_ids()->clear_ids(); }},
      {"prompt_ids: ids[3] = -3", [](auto* r) { r->mutable_prompt_ids()->add_ids(-3); }},
      {"prompt_ids: ids[3]", [=](auto* r) { r->mutable_prompt_ids()->add_ids(vocab); }},
      {"sampling.max_tokens", [](auto* r) { r->mutable_sampling()->set_max_tokens(0); }},
      {"sampling.max_tokens", [](auto* r) { r->mutable_sampling()->set_max_tokens(100000); }},
      {"sampling.temperature", [](auto* r) { r->mutable_sampling()->set_temperature(-1); }},
      {"sampling.temperature", [](auto* r) { r->mutable_sampling()->set_temperature(NAN); }},
      {"sampling.top_p", [](auto* r) { r->mutable_sampling()->set_top_p(0); }},
      {"sampling.top_p", [](auto* r) { r->mutable_sampling()->set_top_p(1.5f); }},
      {"sampling.top_k", [](auto* r) { r->mutable_sampling()->set_top_k(-1); }},
      {"sampling.stop", [](auto* r) { r->mutable_sampling()->add_stop(""); }},
      {"sampling.stop", [](auto* r) { r->mutable_sampling()->add_stop(std::string(300, 'a')); }},
      {"sampling.stop_token_ids",
       [=](auto* r) { r->mutable_sampling()->add_stop_token_ids(vocab + 5); }},
      {"compression.policy", [](auto* r) { r->mutable_compression()->set_policy("h2o"); }},
      {"or ratio is needed by snapkv",
       [](auto* r) { r->mutable_compression()->set_policy("snapkv"); }},
      {"must exceed the observation window",
       [](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_budget(8);
       }},
      {"kernel must be odd",
       [](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_budget(64);
         r->mutable_compression()->set_kernel(4);
       }},
      {"compression.pool", [](auto* r) { r->mutable_compression()->set_pool("min"); }},
      {"compression.gqa", [](auto* r) { r->mutable_compression()->set_gqa("all"); }},
      {"ratio must be in",
       [](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_ratio(2.0);
       }},
      {"attention.mode", [](auto* r) { r->mutable_attention()->set_mode("magic"); }},
      {"request_id", [](auto* r) { r->set_request_id(std::string(300, 'x')); }},
      {"compression.kernel does not apply to snapkv_pp",
       [](auto* r) {
         r->mutable_compression()->set_policy("snapkv_pp");
         r->mutable_compression()->set_budget(64);
         r->mutable_compression()->set_kernel(7);
       }},
      {"attention: top_r does not apply to quest",
       [](auto* r) {
         r->mutable_attention()->set_mode("quest");
         r->mutable_attention()->set_token_budget(16);
         r->mutable_attention()->set_top_r(4);
       }},
      {"rocketkv sets its own decode attention",
       [](auto* r) {
         r->mutable_compression()->set_policy("rocketkv");
         r->mutable_compression()->set_budget(32);
         r->mutable_attention()->set_mode("quest");
       }},
      {"exceeds the model's context", [](auto* r) { r->mutable_sampling()->set_max_tokens(4000); }},
      // Repeated fields have limits.
      {"sampling.stop_token_ids: at most 64",
       [](auto* r) {
         for (int i = 0; i < 65; ++i) r->mutable_sampling()->add_stop_token_ids(5);
       }},
      {"at most 64 compression.groups",
       [](auto* r) {
         r->mutable_compression()->set_policy("hbw");
         r->mutable_compression()->set_budget(64);
         for (int i = 0; i < 65; ++i) r->mutable_compression()->add_groups(1);
       }},
      // Contradictory or inapplicable parameters.
      {"compression.budget and ratio are both set",
       [](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_budget(64);
         r->mutable_compression()->set_ratio(0.5);
       }},
      {"compression.budget does not apply to full",
       [](auto* r) {
         r->mutable_compression()->set_policy("full");
         r->mutable_compression()->set_budget(64);
       }},
      {"compression.skip_layers",
       [](auto* r) {
         r->mutable_compression()->set_policy("snapkv");
         r->mutable_compression()->set_budget(64);
         r->mutable_compression()->set_skip_layers(100);
       }},
      {"attention.top_r: must be at most the head dimension",
       [=](auto* r) {
         r->mutable_attention()->set_mode("hybrid");
         r->mutable_attention()->set_token_budget(16);
         r->mutable_attention()->set_top_r(head_dim + 1);
       }},
      {"top_k does not apply to dense",
       [](auto* r) {
         r->mutable_attention()->set_mode("dense");
         r->mutable_attention()->set_top_k(8);
       }},
      {"rocketkv",
       [](auto* r) {
         r->mutable_compression()->set_policy("rocketkv");
         r->mutable_compression()->set_budget(8);
       }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest req = Request({1, 100, 200}, 8);
    c.edit(&req);
    const Result r = Call(*stub_, req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.expect << ": " << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(c.expect), std::string::npos)
        << "'" << c.expect << "' not in: " << r.status.error_message();
    EXPECT_TRUE(r.ids.empty());
    // The rich error details name the field in a google.rpc.BadRequest, a path whose last
    // name the message mentions ("sampling.top_p", "prompt_ids[3]").
    google::rpc::Status rich;
    ASSERT_TRUE(rich.ParseFromString(r.status.error_details())) << c.expect;
    EXPECT_EQ(rich.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    EXPECT_EQ(rich.message(), r.status.error_message());
    ASSERT_EQ(rich.details_size(), 1) << c.expect << ": " << r.status.error_message();
    google::rpc::BadRequest bad;
    ASSERT_TRUE(rich.details(0).UnpackTo(&bad)) << rich.details(0).type_url();
    ASSERT_EQ(bad.field_violations_size(), 1);
    const std::string field = bad.field_violations(0).field();
    const std::string last = field.substr(field.rfind('.') + 1);
    EXPECT_NE(r.status.error_message().find(last.substr(0, last.find('['))), std::string::npos)
        << field << " vs " << r.status.error_message();
    EXPECT_EQ(bad.field_violations(0).description(), r.status.error_message());
  }
  ExpectPoolEmpty();
  ExpectStillServing();
}

TEST_P(ServicePairTransport, PrefillKilledMidStreamRetriesOnAnotherNode) {
  Faults hold;
  hold.hold_chunk = 2;
  PrefillNode* doomed = AddPrefill("doomed", hold);
  AddPrefill("healthy");
  StartDecode();
  // When a stream reaches its third chunk on the doomed node, the node is shut down, which
  // cancels the stream while that chunk is held back; the two chunks before it have reached
  // the decode node by then, so the attempt counts.
  ShutDownWhenHeld(doomed, std::chrono::milliseconds(200));
  // Round robin spreads requests over both nodes, so one meets the doomed node.
  v1::GenerateRequest req = Request(LongPrompt(200), 8);
  req.mutable_compression()->set_policy("snapkv");
  req.mutable_compression()->set_budget(32);
  int retried = 0;
  for (int i = 0; i < 4; ++i) {
    const Result r = Call(*stub_, req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.ids.size(), 8u);
    EXPECT_EQ(r.final.stats().prefill_node(), "healthy");
    retried += r.final.stats().prefill_attempts() > 1;
  }
  helpers_.back().join();
  helpers_.pop_back();
  EXPECT_TRUE(doomed->faults->WaitHeld()) << "a stream reached the doomed node";
  EXPECT_GE(retried, 1) << "the request that met the dying node was retried";
  ExpectPoolEmpty();
  ExpectStillServing();
}

TEST_F(ServicePairTest, PrefillKilledWithNoOtherNodeFailsCleanly) {
  Faults hold;
  hold.hold_chunk = 1;
  PrefillNode* victim = AddPrefill("prefill", hold);
  const int port = victim->port();
  ShutDownWhenHeld(victim);
  DecodeServerOptions d;
  d.engine.prefill_attempts = 2;
  d.engine.prefill_wait_ms = 500;  // then the second attempt finds no node to reach
  StartDecode(d);
  const Result r = Call(*stub_, Request(LongPrompt(120), 8));
  EXPECT_FALSE(r.status.ok());
  EXPECT_TRUE(r.status.error_code() == grpc::StatusCode::UNAVAILABLE ||
              r.status.error_code() == grpc::StatusCode::CANCELLED)
      << r.status.error_code() << " " << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("prefill"), std::string::npos)
      << r.status.error_message();
  ExpectPoolEmpty();
  // A replacement prefill node on the same port: the decode node serves again.
  AddPrefill("prefill", {}, "127.0.0.1:" + std::to_string(port));
  const auto until = SteadyClock::now() + std::chrono::seconds(10);
  Result ok;
  do {
    ok = Call(*stub_, Request(LongPrompt(120), 4));
  } while (!ok.status.ok() && SteadyClock::now() < until);
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
}

// A reader that falls behind (here: one that takes nothing for a while, over a channel whose
// flow-control window is small, so the node's writes wait) gets the same tokens, text and
// log-probabilities in fewer messages: the node folds what the writer has not caught up with
// into the message that waits, rather than queueing a message per token.
TEST_F(ServicePairTest, ReaderBehindGetsTheSameTokensInFewerMessages) {
  AddPrefill();
  StartDecode();
  v1::GenerateRequest req = Request(LongPrompt(40), 400);
  req.mutable_sampling()->set_ignore_eos(true);
  req.set_return_logprobs(true);
  const Result reader = Call(*stub_, req);
  ASSERT_TRUE(reader.status.ok()) << reader.status.error_message();
  ASSERT_EQ(reader.ids.size(), 400u);

  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto slow_channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(decode_->port()),
                                                grpc::InsecureChannelCredentials(), args);
  auto slow_stub = v1::Generation::NewStub(slow_channel);
  const Result behind = Call(*slow_stub, req, 30000, [](grpc::ClientContext&, int messages) {
    if (messages == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  });
  ASSERT_TRUE(behind.status.ok()) << behind.status.error_message();
  EXPECT_EQ(behind.ids, reader.ids);
  EXPECT_EQ(behind.text, reader.text);
  EXPECT_EQ(behind.logprobs, reader.logprobs);
  EXPECT_EQ(behind.final.usage().completion_tokens(), 400);
  // A reader that keeps up gets up to a message per token and the final one.
  EXPECT_LT(behind.messages, 200) << "tokens were not folded (" << reader.messages
                                  << " messages for a reader that keeps up)";
  ExpectPoolEmpty();
}

// --stream-interval 8: the first token alone (time to first token), then 8 tokens a message
// (fewer if a message waited and took more), the rest with the end; the same tokens, text and
// log-probabilities as streaming every token.
TEST_F(ServicePairTest, StreamIntervalSendsTheFirstTokenThenEveryNTokens) {
  AddPrefill();
  DecodeServerOptions o;
  o.stream_interval = 8;
  StartDecode(o);
  v1::GenerateRequest req = Request(LongPrompt(40), 50);
  req.mutable_sampling()->set_ignore_eos(true);
  req.set_return_logprobs(true);
  const Result r = Call(*stub_, req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_FALSE(r.tokens_per_message.empty());
  EXPECT_EQ(r.tokens_per_message.front(), 1);
  for (size_t i = 1; i + 1 < r.tokens_per_message.size(); ++i) {
    EXPECT_EQ(r.tokens_per_message[i] % 8, 0) << "message " << i;
  }
  EXPECT_LE(r.tokens_per_message.size(), 8u);  // 1 + 6 x 8 + 1

  decode_.reset();
  StartDecode();  // --stream-interval 1
  const Result every = Call(*stub_, req);
  ASSERT_TRUE(every.status.ok()) << every.status.error_message();
  EXPECT_EQ(r.ids, every.ids);
  EXPECT_EQ(r.text, every.text);
  EXPECT_EQ(r.logprobs, every.logprobs);
  EXPECT_EQ(r.final.usage().completion_tokens(), 50);
  // The prompt's tokens on the first message only, as the usage counts them.
  for (const Result* each : {&r, &every}) {
    ASSERT_GE(each->prompt_tokens.size(), 2u);
    EXPECT_EQ(each->prompt_tokens[0], 40u);
    EXPECT_EQ(each->final.usage().prompt_tokens(), 40);
    for (size_t i = 1; i < each->prompt_tokens.size(); ++i) EXPECT_EQ(each->prompt_tokens[i], 0u);
  }
  ExpectPoolEmpty();
}

TEST_F(ServicePairTest, StreamIntervalOutOfRangeIsRefused) {
  for (int bad : {0, -1, kMaxStreamInterval + 1}) {
    DecodeServerOptions o;
    o.listen = "127.0.0.1:0";
    o.stream_interval = bad;
    auto s = DecodeServer::Start(decode_model_.get(), std::move(o));
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("--stream-interval"), std::string::npos)
        << s.status().message();
  }
}

TEST_P(ServicePairTransport, ClientCancellationFreesEverything) {
  AddPrefill();
  StartDecode();
  v1::GenerateRequest req = Request(LongPrompt(100), 400);
  req.mutable_sampling()->set_ignore_eos(true);
  const Result r = Call(*stub_, req, 30000, [](grpc::ClientContext& ctx, int messages) {
    if (messages == 3) ctx.TryCancel();
  });
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(r.ids.size(), 400u);
  ExpectPoolEmpty();
  ExpectStillServing();
}

TEST_P(ServicePairTransport, CancellationDuringPrefillCancelsThePrefill) {
  Faults hold;
  hold.hold_chunk = 0;
  PrefillNode* node = AddPrefill("prefill", hold);
  StartDecode();
  grpc::ClientContext ctx;
  std::thread canceller([&] {
    if (node->faults->WaitHeld()) ctx.TryCancel();  // the prefill is under way
  });
  auto reader = stub_->Generate(&ctx, Request(LongPrompt(100), 8));
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  canceller.join();
  ExpectPoolEmpty();
  node->Release();
  ExpectStillServing();
}

TEST_F(ServicePairTest, DeadlineExpiry) {
  Faults hold;
  hold.hold_chunk = 0;  // held until the decode node gives up on it
  PrefillNode* node = AddPrefill("prefill", hold);
  StartDecode();
  const Result r = Call(*stub_, Request(LongPrompt(100), 8), /*deadline_ms=*/150);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << r.status.error_message();
  ExpectPoolEmpty();
  node->Release();
  ExpectStillServing();
}

size_t CacheBytes(const LlamaModel& m, int prompt, int max_tokens) {
  return KvCache::BytesFor(
      CompressedCacheShape(CompressionConfig{}, m.config(), m.kv_dtype(), prompt, max_tokens));
}

TEST_F(ServicePairTest, FullPoolWaitsForRoom) {
  AddPrefill();
  DecodeServerOptions o;
  o.kv_pool_bytes = CacheBytes(*decode_model_, 100, 100) * 3 / 2;  // one 200-token request
  o.kv_page_bytes = 4096;
  StartDecode(o);
  // Too big for the pool whatever happens: refused at once, saying why.
  const Result huge = Call(*stub_, Request(LongPrompt(200), 300));
  EXPECT_EQ(huge.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(huge.status.error_message().find("pool holds"), std::string::npos)
      << huge.status.error_message();
  // Two that fit only one at a time: the second waits for the first, then runs.
  v1::GenerateRequest req = Request(LongPrompt(100), 100);
  req.mutable_sampling()->set_ignore_eos(true);
  std::vector<Result> both(2);
  std::thread t1([&] { both[0] = Call(*stub_, req); });
  std::thread t2([&] { both[1] = Call(*stub_, req); });
  t1.join();
  t2.join();
  for (const Result& r : both) {
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.ids.size(), 100u);
  }
  EXPECT_EQ(both[0].ids, both[1].ids);
  ExpectPoolEmpty();
}

TEST_F(ServicePairTest, FullPoolRefusesAfterTheQueueTimeout) {
  Faults hold;
  hold.hold_chunk = 0;  // the first request keeps its memory until released
  PrefillNode* node = AddPrefill("prefill", hold);
  DecodeServerOptions o;
  o.kv_pool_bytes = CacheBytes(*decode_model_, 100, 100) * 3 / 2;
  o.kv_page_bytes = 4096;
  o.engine.queue_timeout_ms = 150;
  StartDecode(o);
  v1::GenerateRequest req = Request(LongPrompt(100), 100);
  std::vector<Result> both(2);
  std::thread t1([&] { both[0] = Call(*stub_, req); });
  ASSERT_TRUE(node->faults->WaitHeld());  // admitted, its memory reserved
  std::thread t2([&] { both[1] = Call(*stub_, req); });
  t2.join();
  node->Release();
  t1.join();
  EXPECT_TRUE(both[0].status.ok()) << both[0].status.error_message();
  EXPECT_EQ(both[1].status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(both[1].status.error_message().find("waited 150 ms"), std::string::npos)
      << both[1].status.error_message();
  ExpectPoolEmpty();
  ExpectStillServing();
}

TEST_P(ServicePairTransport, CorruptedChunkIsRejectedByChecksum) {
  Faults corrupt;
  corrupt.corrupt_chunk = 1;
  AddPrefill("corrupting", corrupt);
  DecodeServerOptions o;
  o.engine.prefill_attempts = 1;
  StartDecode(o);
  const Result r = Call(*stub_, Request(LongPrompt(150), 8));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DATA_LOSS) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("CRC-32C mismatch"), std::string::npos)
      << r.status.error_message();
  ExpectPoolEmpty();
  // With a healthy node beside it, the retry lands there and the request succeeds.
  AddPrefill("good");
  decode_.reset();
  StartDecode();
  for (int i = 0; i < 3; ++i) {
    const Result ok = Call(*stub_, Request(LongPrompt(150), 8));
    ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
    EXPECT_EQ(ok.final.stats().prefill_node(), "good");
  }
  ExpectPoolEmpty();
}

// grpc.health.v1.Health/Check's answer for the whole server ("" service): the serialized
// HealthCheckResponse, field 1 varint 1 (SERVING) or 2 (NOT_SERVING); an RPC error's message
// otherwise.
const std::string kServing("\x08\x01", 2), kNotServing("\x08\x02", 2);
std::string HealthOf(int port) {
  auto ch =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1), response;  // HealthCheckRequest{service: ""}: empty
  grpc::GenericStub generic(ch);
  grpc::Status st;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      st = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!st.ok()) return "error: " + st.error_message();
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return "error: unreadable response";
  std::string out;
  for (const grpc::Slice& sl : slices) {
    out.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return out;
}

TEST_F(ServicePairTest, HealthCheckingIsServing) {
  AddPrefill();
  StartDecode();
  for (int port : {decode_->port(), prefills_[0]->port()}) EXPECT_EQ(HealthOf(port), kServing);
}

// A device fault that leaves the device unusable (CUDA's sticky errors; injected here into the
// guarded backend, which then runs nothing more) takes the node out of service: its health goes
// NOT_SERVING with no request in flight, and the calls it gets are refused at once saying why.
// The decode node's retry takes the other prefill node meanwhile.
TEST_F(ServicePairTest, ADeviceFaultTakesTheNodeOutOfService) {
  LoadOptions guarded;
  guarded.backend = kernels::BackendKind::kGuarded;
  LoadNodeModels(guarded);
  auto own = LlamaModel::Load(ModelSpec(), guarded);
  ASSERT_TRUE(own.ok()) << own.status();
  other_models_.push_back(*std::move(own));
  LlamaModel* faulty = other_models_.back().get();
  PrefillNode* bad = AddPrefill("p-faulty", {}, "127.0.0.1:0", faulty);
  AddPrefill("p-ok");
  DecodeServerOptions o;
  o.engine.local_prefill_below = 0;
  StartDecode(o);
  EXPECT_EQ(HealthOf(bad->port()), kServing);
  const absl::Status fault =
      absl::InternalError("cudaStreamSynchronize: an illegal memory access was encountered");
  faulty->backend()->MarkFaulted(fault);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (HealthOf(bad->port()) != kNotServing && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(HealthOf(bad->port()), kNotServing);
  EXPECT_EQ(HealthOf(prefills_[1]->port()), kServing);
  for (int i = 0; i < 4; ++i) {
    const Result r = Call(*stub_, Request(LongPrompt(40 + i), 2));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.final.stats().prefill_node(), "p-ok");
  }
  // The decode node's own device: refused at once, and out of service.
  decode_model_->backend()->MarkFaulted(fault);
  const Result refused = Call(*stub_, Request(LongPrompt(40), 2));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.status.error_message().find("out of service"), std::string::npos)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("illegal memory access"), std::string::npos)
      << refused.status.error_message();
  EXPECT_EQ(HealthOf(decode_->port()), kNotServing);
}

TEST_F(ServicePairTest, OversizedRequestMessageIsRefused) {
  AddPrefill();
  DecodeServerOptions o;
  o.max_message_bytes = 4096;
  StartDecode(o);
  v1::GenerateRequest req;
  req.set_prompt(std::string(8000, 'a'));
  const Result r = Call(*stub_, req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << r.status.error_message();
  ExpectStillServing();
}

}  // namespace
}  // namespace kvwire
