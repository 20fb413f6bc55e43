#include "prefill_service/prefill_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/server/grpc_stream.h"
#include "common/server/trace_metadata.h"
#include "common/telemetry/telemetry.h"
#include "kvwire/v1/prefill.grpc.pb.h"
#include "prefill_service/translate.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

using Stream = StreamState<grpc::ByteBuffer>;

// Chunks queued ahead of the network per stream: enough to keep it busy while the next
// layer computes, few enough that a slow reader does not make the node buffer the cache.
constexpr size_t kMaxQueuedChunks = 8;

// The engine's KV stream as PrefillResponse messages on the call's stream.
class GrpcStreamSink final : public KvStreamSink {
 public:
  GrpcStreamSink(std::shared_ptr<Stream> stream, std::chrono::milliseconds send_timeout)
      : stream_(std::move(stream)), send_timeout_(send_timeout) {}

  absl::Status OnHeader(const WireHeader& header) override {
    v1::PrefillResponse msg;
    *msg.mutable_header() = ToProto(header);
    return Send(msg);
  }
  absl::Status OnChunk(WireChunk chunk) override {
    v1::PrefillResponse msg;
    ToProto(std::move(chunk), msg.mutable_chunk());
    switch (stream_->WaitForRoom(kMaxQueuedChunks, send_timeout_)) {
      case Stream::Room::kReady:
        return Send(msg);
      case Stream::Room::kEnded:
        return Gone();
      case Stream::Room::kStalled:
        break;
    }
    return absl::DeadlineExceededError(
        absl::StrCat("the decode node read no KV chunk for ", send_timeout_.count(),
                     " ms (--send-timeout-ms); the stream was cancelled"));
  }
  absl::Status OnTrailer(const WireTrailer& trailer) override {
    v1::PrefillResponse msg;
    *msg.mutable_trailer() = ToProto(trailer);
    return Send(msg);
  }
  bool cancelled() const override { return stream_->cancelled(); }
  absl::string_view transport() const override { return "grpc"; }
  // Every message of the stream, as the decode node counts them.
  int64_t transport_bytes() const override { return bytes_.load(); }

 private:
  static absl::Status Gone() { return absl::CancelledError("the decode node went away"); }
  absl::Status Send(const v1::PrefillResponse& msg) {
    grpc::ByteBuffer bytes = SerializeMessage(msg);
    bytes_ += static_cast<int64_t>(bytes.Length());
    return stream_->Send(std::move(bytes)) ? absl::OkStatus() : Gone();
  }

  std::shared_ptr<Stream> stream_;
  const std::chrono::milliseconds send_timeout_;
  std::atomic<int64_t> bytes_{0};
};

// "authorization: Bearer <token>", compared in time independent of where it differs.
bool Authorized(const grpc::CallbackServerContext& ctx, const std::string& token) {
  const std::string want = absl::StrCat("Bearer ", token);
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end() || it->second.size() != want.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < want.size(); ++i) diff |= it->second.data()[i] ^ want[i];
  return diff == 0;
}

}  // namespace

struct PrefillServer::Impl final
    : public v1::Prefill::WithRawCallbackMethod_Prefill<v1::Prefill::Service> {
  PrefillExecutor* prefills;
  PrefillServerOptions options;
  std::unique_ptr<grpc::Server> server;
  int port = 0;

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Prefill(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* raw) override {
    auto [stream, reactor] = Stream::Create(ctx);
    absl::Status st = Serve(*ctx, *raw, stream);
    if (!st.ok()) {
      if (options.telemetry) options.telemetry->CountRequest(st);
      stream->Finish(ToGrpcStatus(st));
    }
    return reactor;
  }

  // The call handed to the engine, or why not.
  absl::Status Serve(const grpc::CallbackServerContext& ctx, const grpc::ByteBuffer& raw,
                     const std::shared_ptr<Stream>& stream) {
    if (!options.auth_token.empty() && !Authorized(ctx, options.auth_token)) {
      return absl::UnauthenticatedError("missing or wrong bearer token");
    }
    v1::PrefillRequest request;
    RETURN_IF_ERROR(ParseRequest(raw, &request));
    ASSIGN_OR_RETURN(PrefillJob job, TranslatePrefillRequest(request));
    job.deadline = FromWallDeadline(Clock::Real(), ctx.deadline(), options.max_deadline);
    job.trace = TraceFromMetadata(ctx.client_metadata());
    return prefills->Submit(
        std::move(job), std::make_shared<GrpcStreamSink>(stream, options.send_timeout),
        [stream = stream](const absl::Status& done) { stream->Finish(ToGrpcStatus(done)); });
  }
};

PrefillServer::PrefillServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PrefillServer::~PrefillServer() { Shutdown(0); }

absl::StatusOr<std::unique_ptr<PrefillServer>> PrefillServer::Start(PrefillExecutor* prefills,
                                                                    PrefillServerOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->prefills = prefills;
  impl->options = std::move(options);
  const PrefillServerOptions& o = impl->options;
  if (o.max_request_bytes < 1024 || o.max_request_bytes > (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request size limit must be in [1KiB, 1GiB], got ", o.max_request_bytes, " bytes"));
  }
  if (o.send_timeout.count() < 1 || o.max_deadline.count() < 1) {
    return absl::InvalidArgumentError("the send timeout and the maximum deadline must be >= 1 ms");
  }
  if (!o.insecure && o.tls.client_ca_file.empty() && o.auth_token.empty() &&
      !IsLoopbackAddress(o.listen)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "listening on ", o.listen,
        " the node would serve K/V data to any caller: authenticate callers with mutual TLS "
        "(--tls-cert, --tls-key, --tls-client-ca) or --auth-token-file, or accept it with "
        "--insecure"));
  }
  ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(o.tls));
  grpc::EnableDefaultHealthCheckService(true);
  // The plugin is process-wide: a server built later in this process gets it too.
  if (o.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(o.listen, creds, &impl->port);
  builder.RegisterService(impl.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(o.max_request_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(kMaxChunkBytesLimit + (1 << 20)));
  // Connections age out so that decode nodes re-resolve the prefill Service now and then
  // and spread over new replicas; streams in flight get the grace period to finish.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, 10 * 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 2 * 60 * 1000);
  // Decode nodes ping every kKeepaliveMs to find a hung node (grpc_kv_source.cc); accept
  // pings that often, also between calls, rather than answering them with GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kKeepaliveMs / 2);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", o.listen));
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
