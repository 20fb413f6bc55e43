#include "decode_service/decode_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>
#include <cmath>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status.h"
#include "common/engine/local_kv_source.h"
#include "common/server/grpc_stream.h"
#include "common/server/trace_metadata.h"
#include "common/telemetry/telemetry.h"
#include "decode_service/grpc_kv_source.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

using Stream = StreamState<grpc::ByteBuffer>;

constexpr int kMaxStopStrings = 16;
constexpr int kMaxStopTokenIds = 64;
constexpr size_t kMaxStopBytes = 256;
constexpr size_t kMaxRequestIdBytes = 256;

// The client stream in the engine's terms.
class GrpcSink final : public ResponseSink {
 public:
  GrpcSink(std::shared_ptr<Stream> stream, std::string request_id)
      : stream_(std::move(stream)), request_id_(std::move(request_id)) {}

  bool Send(TokenDelta delta) override {
    v1::GenerateResponse r;
    r.set_request_id(request_id_);
    for (int32_t id : delta.ids) r.add_token_ids(id);
    r.set_text(std::move(delta.text));
    for (float lp : delta.logprobs) r.add_logprobs(lp);
    return stream_->Send(SerializeMessage(r));
  }

  void Finish(const absl::Status& status, const RequestFigures* f) override {
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
      s->set_decode_node(f->decode_node);
      s->set_attention(f->attention);
      s->set_prefill_attempts(f->prefill_attempts);
      stream_->Send(SerializeMessage(r));
    }
    stream_->Finish(ToGrpcStatus(status));
  }

  bool cancelled() const override { return stream_->cancelled(); }

 private:
  std::shared_ptr<Stream> stream_;
  std::string request_id_;
};

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

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

  // Translates and checks every field; the engine does what needs the tokenizer.
  absl::StatusOr<GenerationJob> Translate(const v1::GenerateRequest& req) {
    const ModelConfig& mc = model->config();
    GenerationJob j;
    if (req.request_id().size() > kMaxRequestIdBytes) {
      return Bad("request_id", absl::StrCat("longer than ", kMaxRequestIdBytes, " bytes"));
    }
    j.request_id = req.request_id().empty()
                       ? absl::StrCat(options.engine.node_name, "-", next_id.fetch_add(1))
                       : req.request_id();
    const int max_prompt =
        options.max_prompt_tokens > 0 ? options.max_prompt_tokens : mc.context_limit();
    switch (req.input_case()) {
      case v1::GenerateRequest::kPrompt:
        if (req.prompt().empty()) return Bad("prompt", "is empty");
        // A generous bound in bytes (tokens are at least one byte) keeps tokenizing cheap.
        if (req.prompt().size() > static_cast<size_t>(max_prompt) * 32) {
          return Bad("prompt", absl::StrCat(req.prompt().size(), " bytes is far beyond the ",
                                            max_prompt, "-token prompt limit"));
        }
        j.prompt_text = req.prompt();
        break;
      case v1::GenerateRequest::kPromptIds: {
        if (req.prompt_ids().ids_size() == 0) return Bad("prompt_ids", "is empty");
        if (req.prompt_ids().ids_size() > max_prompt) {
          return Bad("prompt_ids", absl::StrCat(req.prompt_ids().ids_size(),
                                                " tokens exceeds the limit of ", max_prompt));
        }
        for (int i = 0; i < req.prompt_ids().ids_size(); ++i) {
          const int32_t id = req.prompt_ids().ids(i);
          if (id < 0 || id >= mc.vocab_size) {
            return Bad("prompt_ids",
                       absl::StrCat("ids[", i, "] = ", id, " is outside the vocabulary [0, ",
                                    mc.vocab_size, ")"));
          }
          j.prompt_ids.push_back(id);
        }
        break;
      }
      default:
        return Bad("input", "set either prompt (text) or prompt_ids");
    }

    const v1::SamplingParams& sp = req.sampling();
    j.max_tokens = sp.has_max_tokens() ? sp.max_tokens() : options.default_max_tokens;
    if (j.max_tokens < 1 || j.max_tokens > options.max_tokens_limit) {
      return Bad("sampling.max_tokens", absl::StrCat("must be in [1, ", options.max_tokens_limit,
                                                     "], got ", j.max_tokens));
    }
    j.sampling.temperature = sp.has_temperature() ? sp.temperature() : 0.f;
    if (!std::isfinite(j.sampling.temperature) || j.sampling.temperature < 0 ||
        j.sampling.temperature > 100) {
      return Bad("sampling.temperature",
                 absl::StrCat("must be in [0, 100], got ", j.sampling.temperature));
    }
    j.sampling.top_p = sp.has_top_p() ? sp.top_p() : 1.f;
    if (!(j.sampling.top_p > 0 && j.sampling.top_p <= 1)) {
      return Bad("sampling.top_p", absl::StrCat("must be in (0, 1], got ", j.sampling.top_p));
    }
    j.sampling.top_k = sp.has_top_k() ? sp.top_k() : 0;
    if (j.sampling.top_k < 0) {
      return Bad("sampling.top_k",
                 absl::StrCat("must be >= 0 (0: no limit), got ", j.sampling.top_k));
    }
    j.seed = sp.has_seed() ? sp.seed() : 0;
    if (sp.stop_size() > kMaxStopStrings) {
      return Bad("sampling.stop",
                 absl::StrCat("at most ", kMaxStopStrings, " strings, got ", sp.stop_size()));
    }
    for (const std::string& s : sp.stop()) {
      if (s.empty() || s.size() > kMaxStopBytes) {
        return Bad("sampling.stop",
                   absl::StrCat("each stop string must be 1..", kMaxStopBytes, " bytes"));
      }
      j.stop.push_back(s);
    }
    if (sp.stop_token_ids_size() > kMaxStopTokenIds) {
      return Bad("sampling.stop_token_ids", absl::StrCat("at most ", kMaxStopTokenIds, " ids, got ",
                                                         sp.stop_token_ids_size()));
    }
    for (int32_t id : sp.stop_token_ids()) {
      if (id < 0 || id >= mc.vocab_size) {
        return Bad("sampling.stop_token_ids",
                   absl::StrCat(id, " is outside the vocabulary [0, ", mc.vocab_size, ")"));
      }
      j.stop_ids.push_back(id);
    }
    if (!sp.ignore_eos()) {
      for (int32_t e : mc.eos_token_ids) j.stop_ids.push_back(e);
      if (mc.eos_token_ids.empty() && model->tokenizer().eos_id()) {
        j.stop_ids.push_back(*model->tokenizer().eos_id());
      }
    }

    j.compression = options.default_compression;
    RETURN_IF_ERROR(ApplyCompressionParams(req.compression(), &j.compression));
    RETURN_IF_ERROR(RenameParams(j.compression.ValidateFor(mc.num_layers), [](absl::string_view n) {
      return absl::StrCat("compression.", n);
    }));
    const v1::DecodeAttentionParams& ap = req.attention();
    const bool attention_set = !ap.mode().empty() || ap.has_token_budget() || ap.has_top_k() ||
                               ap.has_top_r() || ap.has_page_size();
    if (!j.compression.policy->selects()) {
      // rocketkv derives its stage-2 attention from its own budget: nothing to set.
      if (attention_set) {
        return Bad("attention", absl::StrCat(j.compression.policy_name(),
                                             " sets its own decode attention (hybrid, from "
                                             "compression.budget); leave attention unset"));
      }
      j.logprobs = req.return_logprobs();
      return j;
    }
    j.attention = options.default_attention;
    if (!ap.mode().empty()) {
      auto mode = ParseAttentionMode(ap.mode());
      if (!mode.ok()) return Bad("attention.mode", mode.status().message());
      if (*mode != j.attention.mode) {
        // Another mode starts from its own defaults; a token budget is every sparse mode's.
        DecodeAttentionConfig other{*mode};
        if (*mode != AttentionMode::kDense) other.token_budget = j.attention.token_budget;
        j.attention = other;
      }
    }
    if (ap.has_token_budget()) j.attention.token_budget = ap.token_budget();
    if (ap.has_top_k()) j.attention.top_k = ap.top_k();
    if (ap.has_top_r()) j.attention.top_r = ap.top_r();
    if (ap.has_page_size()) j.attention.page_size = ap.page_size();
    RETURN_IF_ERROR(j.attention.Validate());  // "attention: top_r does not apply to quest ..."
    if (j.attention.top_r > mc.head_dim) {
      return Bad("attention.top_r", absl::StrCat("must be at most the head dimension (",
                                                 mc.head_dim, "), got ", j.attention.top_r));
    }
    j.logprobs = req.return_logprobs();
    return j;
  }

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
    v1::GenerateRequest request;
    RETURN_IF_ERROR(ParseRequest(raw, &request));
    ASSIGN_OR_RETURN(GenerationJob job, Translate(request));
    const Clock& clock = *options.engine.clock;
    job.deadline = std::min(
        FromWallDeadline(clock, ctx.deadline()),
        clock.Now() + std::chrono::duration_cast<Clock::TimePoint::duration>(options.max_deadline));
    job.trace = TraceFromMetadata(ctx.client_metadata());
    auto sink = std::make_shared<GrpcSink>(stream, job.request_id);
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
  impl->pool =
      std::make_unique<KvPool>(o.kv_pool_bytes, o.kv_page_bytes, [raw] { raw->WakeEngine(); });
  if (!o.prefill_target.empty()) {
    ASSIGN_OR_RETURN(impl->remote, GrpcKvSource::Create(o.prefill_target, o.prefill_tls,
                                                        o.prefill_auth_token, *o.engine.clock));
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
