#include "decode_service/decode_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>
#include <cmath>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status.h"
#include "common/engine/local_kv_source.h"
#include "common/server/fault_watch.h"
#include "common/server/grpc_stream.h"
#include "common/server/grpc_util.h"
#include "common/server/trace_metadata.h"
#include "common/telemetry/telemetry.h"
#include "decode_service/grpc_kv_source.h"
#include "decode_service/translate.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

using Stream = StreamState<grpc::ByteBuffer>;

// The client stream in the engine's terms.
//
// --stream-interval N (vLLM's and SGLang's flag of that name): the first token goes at once
// (time to first token), then a message every N tokens, and what is left goes with the end.
// Independently of it, tokens the writer has not caught up with are folded into the message
// that waits for it (StreamState::SendFoldable), up to kMaxFoldedTokens a message: a reader
// that is behind (a slow client, a busy front or router) takes the same tokens in fewer
// messages, and a node that runs ahead holds a few messages per stream, not one per token.
class GrpcSink final : public ResponseSink {
 public:
  static constexpr int kMaxFoldedTokens = 256;

  GrpcSink(std::shared_ptr<Stream> stream, std::string request_id, int stream_interval,
           int prompt_tokens)
      : stream_(std::move(stream)),
        request_id_(std::move(request_id)),
        stream_interval_(stream_interval),
        prompt_tokens_(prompt_tokens) {}

  bool Send(TokenDelta delta) override {
    Append(delta, &held_);
    if (sent_any_ && held_.token_ids_size() < stream_interval_) return !stream_->cancelled();
    sent_any_ = true;
    return SendHeld();
  }

  void Finish(const absl::Status& status, const RequestFigures* f) override {
    if (status.ok() && held_.token_ids_size() > 0) SendHeld();
    FinishNow(status, f);
  }

  bool cancelled() const override { return stream_->cancelled(); }

 private:
  // Sends the tokens in `held_` as a message of their own, or folded into the one waiting.
  bool SendHeld() {
    const bool ok = stream_->SendFoldable(
        [&] {                     // a new message: `waiting_` is its contents from now on
          waiting_.Swap(&held_);  // held_ is cleared below
          waiting_.set_request_id(request_id_);
          waiting_.set_prompt_tokens(first_ ? prompt_tokens_ : 0);
          first_ = false;
          return SerializeMessage(waiting_);
        },
        [&](grpc::ByteBuffer* queued) {  // `waiting_` is `queued`'s contents
          if (waiting_.token_ids_size() + held_.token_ids_size() > kMaxFoldedTokens) return false;
          AppendTokens(held_, &waiting_);
          *queued = SerializeMessage(waiting_);
          return true;
        });
    held_.Clear();
    return ok;
  }

  // A delta's tokens, text and log-probabilities; with log-probabilities, each token's own
  // text too (token_texts), which a message of several tokens would otherwise lose.
  static void Append(const TokenDelta& delta, v1::GenerateResponse* r) {
    for (int32_t id : delta.ids) r->add_token_ids(id);
    r->mutable_text()->append(delta.text);
    if (delta.logprobs.empty()) return;
    for (float lp : delta.logprobs) r->add_logprobs(lp);
    // A delta of several tokens ends a UTF-8 character the tokens before its last began.
    for (size_t i = 1; i < delta.ids.size(); ++i) r->add_token_texts();
    if (!delta.ids.empty()) r->add_token_texts(delta.text);
  }
  static void AppendTokens(const v1::GenerateResponse& from, v1::GenerateResponse* to) {
    to->mutable_token_ids()->MergeFrom(from.token_ids());
    to->mutable_text()->append(from.text());
    to->mutable_logprobs()->MergeFrom(from.logprobs());
    to->mutable_token_texts()->MergeFrom(from.token_texts());
  }

  void FinishNow(const absl::Status& status, const RequestFigures* f) {
    if (status.ok() && f != nullptr) {
      v1::GenerateResponse r;
      r.set_request_id(request_id_);
      v1::Final* fin = r.mutable_final();
      fin->set_finish_reason(f->finish == FinishReason::kStop ? v1::FINISH_REASON_STOP
                                                              : v1::FINISH_REASON_LENGTH);
      fin->mutable_usage()->set_prompt_tokens(f->prompt_tokens);
      fin->mutable_usage()->set_completion_tokens(f->completion_tokens);
      v1::RequestStats* s = fin->mutable_stats();
      s->set_prompt_tokens(f->prompt_tokens);
      s->set_kept_tokens(f->kept_tokens);
      s->set_full_cache_bytes(f->full_cache_bytes);
      s->set_wire_bytes(f->wire_bytes);
      s->set_kv_payload_bytes(f->kv_payload_bytes);
      s->set_transfer_ms(f->transfer_ms);
      s->set_prefill_ms(f->prefill_ms);
      s->set_queue_ms(f->queue_ms);
      s->set_ttft_ms(f->ttft_ms);
      s->set_mean_itl_ms(f->mean_itl_ms);
      s->set_policy(f->policy);
      s->set_prefill_node(f->prefill_node);
      s->set_cached_tokens(f->cached_tokens);
      s->set_decode_node(f->decode_node);
      s->set_attention(f->attention);
      s->set_prefill_attempts(f->prefill_attempts);
      stream_->Send(SerializeMessage(r));
    }
    stream_->Finish(ToGrpcStatus(status));
  }

  std::shared_ptr<Stream> stream_;
  std::string request_id_;
  const int stream_interval_;
  const int prompt_tokens_;
  bool sent_any_ = false;
  bool first_ = true;             // the next new message is the stream's first
  v1::GenerateResponse held_;     // tokens not sent yet (--stream-interval), no request_id
  v1::GenerateResponse waiting_;  // the last message queued, while SendFoldable may fold
};

}  // namespace

struct DecodeServer::Impl final
    : public v1::Generation::WithRawCallbackMethod_Generate<v1::Generation::Service> {
  LlamaModel* model;
  DecodeServerOptions options;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<GrpcKvSource> remote;  // the prefill nodes, when --prefill names them
  std::unique_ptr<PrefillEngine> local_prefill;
  std::unique_ptr<LocalKvSource> local;
  std::unique_ptr<DecodeEngine> engine;
  // Stream and pool callbacks can fire while Shutdown destroys the engine; they wake it
  // only under this lock, and Shutdown clears `live_engine` under it first.
  absl::Mutex wake_mu;
  DecodeEngine* live_engine ABSL_GUARDED_BY(wake_mu) = nullptr;
  void WakeEngine() {
    absl::MutexLock lock(&wake_mu);
    if (live_engine != nullptr) live_engine->Wake();
  }
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::atomic<uint64_t> next_id{1};
  // After the server: destroyed first, so that it never touches a server that is gone.
  std::unique_ptr<FaultWatch> fault_watch;

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* raw) override {
    auto [stream, reactor] = Stream::Create(ctx, [this] { WakeEngine(); });
    if (absl::Status st = Serve(*ctx, *raw, stream); !st.ok()) {
      if (options.telemetry) options.telemetry->CountRequest(st);
      stream->Finish(ToGrpcStatus(st));
    }
    return reactor;
  }

  // The request handed to the engine, or why not.
  absl::Status Serve(const grpc::CallbackServerContext& ctx, const grpc::ByteBuffer& raw,
                     const std::shared_ptr<Stream>& stream) {
    RETURN_IF_ERROR(fault_watch->Check());  // a faulted device: UNAVAILABLE, try another node
    v1::GenerateRequest request;
    RETURN_IF_ERROR(ParseRequest(raw, &request));
    ASSIGN_OR_RETURN(GenerationJob job,
                     TranslateGenerateRequest(request, *model, options, next_id.fetch_add(1)));
    job.deadline = FromWallDeadline(*options.engine.clock, ctx.deadline(), options.max_deadline);
    job.trace = TraceFromMetadata(ctx.client_metadata());
    auto sink = std::make_shared<GrpcSink>(stream, job.request_id, options.stream_interval,
                                           static_cast<int>(job.prompt_ids.size()));
    return engine->Submit(std::move(job), sink);
  }
};

DecodeServer::DecodeServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DecodeServer::~DecodeServer() { Shutdown(0); }

absl::StatusOr<std::unique_ptr<DecodeServer>> DecodeServer::Start(LlamaModel* model,
                                                                  DecodeServerOptions options) {
  RETURN_IF_ERROR(options.default_compression.Validate());
  if (options.engine.max_batch < 1 || options.engine.max_queue < 1 ||
      options.engine.prefill_attempts < 1) {
    return absl::InvalidArgumentError(
        "need --max-batch >= 1, --max-queue >= 1, --prefill-attempts >= 1");
  }
  if (options.default_max_tokens < 1 || options.max_tokens_limit < options.default_max_tokens) {
    return absl::InvalidArgumentError("need 1 <= --default-max-tokens <= --max-tokens-limit");
  }
  if (options.stream_interval < 1 || options.stream_interval > kMaxStreamInterval) {
    return absl::InvalidArgumentError(absl::StrCat("--stream-interval must be in [1, ",
                                                   kMaxStreamInterval, "] tokens, got ",
                                                   options.stream_interval));
  }
  if (options.engine.max_chunk_bytes < 1024 ||
      options.engine.max_chunk_bytes > kMaxChunkBytesLimit) {
    return absl::InvalidArgumentError(absl::StrCat("--max-chunk-bytes must be in [1KiB, ",
                                                   kMaxChunkBytesLimit >> 20, "MiB], got ",
                                                   options.engine.max_chunk_bytes));
  }
  if (options.engine.remote != nullptr || options.engine.local != nullptr) {
    return absl::InvalidArgumentError(
        "engine.remote and engine.local are the server's own (--prefill names the prefill nodes)");
  }
  if (options.engine.clock == nullptr) return absl::InvalidArgumentError("engine.clock is null");
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->options = std::move(options);
  DecodeServerOptions& o = impl->options;
  o.engine.telemetry = o.telemetry;
  Impl* raw = impl.get();
  // On a device backend the pool is one slab of its memory, made now: the caches' pages and
  // their selectors' state come from it, and nothing is allocated per request.
  if (model->on_device()) {
    ASSIGN_OR_RETURN(impl->pool, KvPool::OnBackend(model->backend(), o.kv_pool_bytes,
                                                   o.kv_page_bytes, [raw] { raw->WakeEngine(); }));
  } else {
    impl->pool =
        std::make_unique<KvPool>(o.kv_pool_bytes, o.kv_page_bytes, [raw] { raw->WakeEngine(); });
  }
  if (o.kv_transport == KvTransport::kShm && impl->pool->paged()) {
    return absl::FailedPreconditionError(
        "--kv-transport shm writes into caches in host memory, and this node's pool is the "
        "device's (--backend cpu for shm; on a GPU, cuda_ipc)");
  }
  std::string pool_handle;
  if (o.kv_transport == KvTransport::kCudaIpc) {
    if (!impl->pool->paged()) {
      return absl::FailedPreconditionError(
          "--kv-transport cuda_ipc writes into a device pool's pages, and this node's pool is "
          "host memory (--backend cuda for cuda_ipc; on a CPU, shm)");
    }
    // The slab's handle, made once: every request's pages are in it.
    auto exported = impl->pool->backend()->ExportMemory(impl->pool->slab(), impl->pool->capacity());
    if (!exported.ok()) {
      return absl::Status(exported.status().code(),
                          absl::StrCat("--kv-transport cuda_ipc: exporting the KV pool: ",
                                       exported.status().message()));
    }
    pool_handle = *std::move(exported);
  }
  if (o.kv_transport == KvTransport::kNccl && !impl->pool->paged()) {
    return absl::FailedPreconditionError(
        "--kv-transport nccl receives into a device pool's pages, and this node's pool is host "
        "memory (--backend cuda for nccl; on a CPU, grpc or shm)");
  }
  if (!o.prefill_target.empty()) {
    ASSIGN_OR_RETURN(
        impl->remote,
        GrpcKvSource::Create(o.prefill_target, o.prefill_tls, o.prefill_auth_token, *o.engine.clock,
                             o.kv_transport, std::move(pool_handle), impl->pool->capacity(),
                             impl->pool->paged() ? impl->pool->backend() : nullptr,
                             o.prefill_affinity_tokens));
  }
  if (o.kv_transport == KvTransport::kShm) {
    // Shared regions that a decode node on this host left behind when it died, then room for
    // the whole pool: every cache is a region in /dev/shm.
    SweepSharedRegions();
    ASSIGN_OR_RETURN(const size_t room, SharedRegionRoom());
    if (room < o.kv_pool_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("--kv-transport shm keeps every cache in /dev/shm, which has ", room,
                       " bytes free for a pool of ", o.kv_pool_bytes,
                       " (--kv-pool-bytes): lower it, or give /dev/shm more room (a container's "
                       "--shm-size, a memory-backed emptyDir)"));
    }
  }
  // Short prompts (all of them without prefill nodes) prefill on this node's own model,
  // one at a time beside the decode batch.
  PrefillEngineOptions local;
  local.node_name = "local";
  local.workers = 1;
  local.max_queue = o.engine.max_batch;
  local.clock = o.engine.clock;
  impl->local_prefill = std::make_unique<PrefillEngine>(model, local);
  impl->local = std::make_unique<LocalKvSource>(impl->local_prefill.get());
  if (o.telemetry) o.telemetry->SetPool(0, static_cast<double>(o.kv_pool_bytes));
  o.engine.remote = impl->remote.get();
  o.engine.local = impl->local.get();
  impl->engine = std::make_unique<DecodeEngine>(model, impl->pool.get(), o.engine);
  {
    absl::MutexLock lock(&impl->wake_mu);
    impl->live_engine = impl->engine.get();
  }

  std::shared_ptr<kernels::KernelBackend> backend = model->backend();
  impl->fault_watch = std::make_unique<FaultWatch>([backend] { return backend->fault(); },
                                                   impl->options.engine.node_name);
  ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(o.tls));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(o.listen, creds, &impl->port);
  builder.RegisterService(impl.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(o.max_message_bytes));
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", o.listen));
  }
  impl->fault_watch->Attach(impl->server.get());
  return std::unique_ptr<DecodeServer>(new DecodeServer(std::move(impl)));
}

int DecodeServer::port() const { return impl_->port; }
KvPool& DecodeServer::pool() { return *impl_->pool; }
DecodeEngine& DecodeServer::engine() { return *impl_->engine; }

// Health goes NOT_SERVING; the server stops taking calls (GOAWAY tells routers with pooled
// connections to go elsewhere) and waits up to `grace_ms` for the calls it has, which the
// engine keeps serving; at the deadline gRPC cancels what is left.
void DecodeServer::Shutdown(int grace_ms) {
  if (impl_->server == nullptr) return;
  if (auto* health = impl_->server->GetHealthCheckService()) health->Shutdown();
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  impl_->engine->Drain(std::chrono::milliseconds(0));
  {
    absl::MutexLock lock(&impl_->wake_mu);
    impl_->live_engine = nullptr;
  }
  impl_->engine.reset();
  impl_->local_prefill->Shutdown();
  impl_->server.reset();
}

void DecodeServer::Wait() {
  if (impl_->server) impl_->server->Wait();
}

}  // namespace kvwire
