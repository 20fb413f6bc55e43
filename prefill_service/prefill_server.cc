#include "prefill_service/prefill_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/server/grpc_stream.h"
#include "common/server/trace_metadata.h"
#include "common/telemetry/telemetry.h"
#include "kvwire/v1/prefill.grpc.pb.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

using Stream = StreamState<v1::PrefillResponse>;

// Chunks queued ahead of the network per stream: enough to keep it busy while the next
// layer computes, few enough that a slow reader does not make the node buffer the cache.
constexpr size_t kMaxQueuedChunks = 8;

// The engine's KV stream as PrefillResponse messages on the call's stream.
class GrpcStreamSink final : public KvStreamSink {
 public:
  explicit GrpcStreamSink(std::shared_ptr<Stream> stream) : stream_(std::move(stream)) {}

  absl::Status OnHeader(const WireHeader& header) override {
    v1::PrefillResponse msg;
    *msg.mutable_header() = ToProto(header);
    return Send(std::move(msg));
  }
  absl::Status OnChunk(WireChunk chunk) override {
    v1::PrefillResponse msg;
    ToProto(std::move(chunk), msg.mutable_chunk());
    if (!stream_->WaitForRoom(kMaxQueuedChunks)) return Gone();
    return Send(std::move(msg));
  }
  absl::Status OnTrailer(const WireTrailer& trailer) override {
    v1::PrefillResponse msg;
    *msg.mutable_trailer() = ToProto(trailer);
    return Send(std::move(msg));
  }
  bool cancelled() const override { return stream_->cancelled(); }
  absl::string_view transport() const override { return "grpc"; }
  // Every message of the stream, as the decode node counts them.
  int64_t transport_bytes() const override { return bytes_.load(); }

 private:
  static absl::Status Gone() { return absl::CancelledError("the decode node went away"); }
  absl::Status Send(v1::PrefillResponse msg) {
    bytes_ += static_cast<int64_t>(msg.ByteSizeLong());
    return stream_->Send(std::move(msg)) ? absl::OkStatus() : Gone();
  }

  std::shared_ptr<Stream> stream_;
  std::atomic<int64_t> bytes_{0};
};

// The request in domain terms: every field parsed; the engine checks them against the model.
absl::StatusOr<PrefillJob> Translate(const v1::PrefillRequest& req,
                                     const grpc::CallbackServerContext& ctx) {
  PrefillJob job;
  job.request_id = req.request_id();
  job.prompt_ids.assign(req.prompt_ids().begin(), req.prompt_ids().end());
  RETURN_IF_ERROR(ApplyCompressionParams(req.compression(), &job.compression));
  job.model_fingerprint = req.model_fingerprint();
  job.max_chunk_bytes = req.max_chunk_bytes() == 0
                            ? kDefaultMaxChunkBytes
                            : std::min<size_t>(req.max_chunk_bytes(), kMaxChunkBytesLimit);
  job.sampling.temperature = req.temperature();
  job.sampling.top_p = req.top_p() == 0 ? 1.f : req.top_p();  // 0: unset
  job.sampling.top_k = req.top_k();
  job.seed = req.seed();
  job.deadline = FromWallDeadline(Clock::Real(), ctx.deadline());
  job.trace = TraceFromMetadata(ctx.client_metadata());
  return job;
}

}  // namespace

struct PrefillServer::Impl final : public v1::Prefill::CallbackService {
  PrefillExecutor* prefills;
  PrefillServerOptions options;
  std::unique_ptr<grpc::Server> server;
  int port = 0;

  grpc::ServerWriteReactor<v1::PrefillResponse>* Prefill(
      grpc::CallbackServerContext* ctx, const v1::PrefillRequest* request) override {
    auto [stream, reactor] = Stream::Create();
    auto job = Translate(*request, *ctx);
    absl::Status st = job.status();
    if (st.ok()) {
      st = prefills->Submit(
          std::move(*job), std::make_shared<GrpcStreamSink>(stream),
          [stream = stream](const absl::Status& done) { stream->Finish(ToGrpcStatus(done)); });
    } else if (options.telemetry) {
      options.telemetry->CountRequest(st);
    }
    if (!st.ok()) stream->Finish(ToGrpcStatus(st));
    return reactor;
  }
};

PrefillServer::PrefillServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PrefillServer::~PrefillServer() { Shutdown(0); }

absl::StatusOr<std::unique_ptr<PrefillServer>> PrefillServer::Start(PrefillExecutor* prefills,
                                                                    PrefillServerOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->prefills = prefills;
  impl->options = std::move(options);
  ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(impl->options.tls));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(impl->options.listen, creds, &impl->port);
  builder.RegisterService(impl.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(impl->options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(kMaxChunkBytesLimit + (1 << 20)));
  // Connections age out so that decode nodes re-resolve the prefill Service now and then
  // and spread over new replicas; streams in flight get the grace period to finish.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, 10 * 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 2 * 60 * 1000);
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", impl->options.listen));
  }
  return std::unique_ptr<PrefillServer>(new PrefillServer(std::move(impl)));
}

int PrefillServer::port() const { return impl_->port; }

void PrefillServer::Shutdown(int grace_ms) {
  if (impl_->server == nullptr) return;
  if (auto* health = impl_->server->GetHealthCheckService()) health->Shutdown();
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  impl_->server.reset();
}

void PrefillServer::Wait() {
  if (impl_->server) impl_->server->Wait();
}

}  // namespace kvwire
