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

// The decode node's cache, mapped from its shared region: KvCache::Create lays it out there as
// the decode node did.
class RegionMemory final : public KvMemory {
 public:
  explicit RegionMemory(SharedRegion* region) : region_(region) {}
  uint8_t* data() override { return region_->data(); }
  size_t size() const override { return region_->size(); }

 private:
  SharedRegion* region_;
};
class RegionAllocator final : public KvAllocator {
 public:
  explicit RegionAllocator(SharedRegion* region) : region_(region) {}
  absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) override {
    if (bytes != region_->size()) {
      return absl::InvalidArgumentError(absl::StrCat("region ", region_->name(), " holds ",
                                                     region_->size(), " bytes, not ", bytes));
    }
    return KvMemoryPtr(new RegionMemory(region_));
  }

 private:
  SharedRegion* region_;
};

// The shm transport's sending end: each chunk's rows and positions written into the decode
// node's cache (the shared region the request names) by the receiving end's own assembler
// (KvAssembler, which checks and stores exactly as the decode node would), and only the chunk's
// rectangle and the checksum of what the region now holds sent on the stream. The region is
// mapped from the header until the stream's sink goes.
class RegionStreamSink final : public KvStreamSink {
 public:
  RegionStreamSink(std::shared_ptr<KvStreamSink> stream, const PrefillJob& job)
      : stream_(std::move(stream)),
        name_(job.region_name),
        bytes_(job.region_bytes),
        shape_(job.region_shape) {}

  absl::Status OnHeader(const WireHeader& h) override {
    auto region = SharedRegion::Open(name_, bytes_);
    if (absl::IsNotFound(region.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          region.status().message(),
          ": the shm KV transport needs the prefill node on the decode node's host (and its "
          "/dev/shm); use grpc between hosts"));
    }
    RETURN_IF_ERROR(region.status());
    region_ = std::move(*region);
    if (static_cast<int>(shape_.capacity.size()) != h.num_layers ||
        shape_.n_heads != h.num_cache_heads || shape_.head_dim != h.head_dim ||
        shape_.dtype != h.dtype || shape_.format != DecodeCacheFormat(h.kv_format)) {
      return absl::InvalidArgumentError(
          absl::StrCat("region: the decode cache has ", shape_.capacity.size(), " layers x ",
                       shape_.n_heads, " heads x ", shape_.head_dim, " ", DTypeName(shape_.dtype),
                       " in ", KvFormatName(shape_.format), "; this prefill streams ", h.num_layers,
                       " x ", h.num_cache_heads, " x ", h.head_dim, " ", DTypeName(h.dtype), " in ",
                       KvFormatName(h.kv_format)));
    }
    RegionAllocator memory(region_.get());
    ASSIGN_OR_RETURN(cache_, KvCache::Create(shape_, memory));
    WireExpectation expect;
    expect.model_fingerprint = h.model_fingerprint;
    expect.num_layers = h.num_layers;
    expect.num_cache_heads = h.num_cache_heads;
    expect.head_dim = h.head_dim;
    expect.dtype = h.dtype;
    expect.kv_format = h.kv_format;
    expect.prompt_len = h.prompt_len;
    expect.max_chunk_bytes = kMaxChunkBytesLimit;
    assembler_ = std::make_unique<KvAssembler>(std::move(expect), cache_.get());
    RETURN_IF_ERROR(assembler_->OnHeader(h));
    kept_ = h.kept_per_layer;
    return stream_->OnHeader(h);
  }
  absl::Status OnChunk(WireChunk chunk) override {
    if (assembler_ == nullptr) return absl::InternalError("a KV chunk before the header");
    RETURN_IF_ERROR(assembler_->OnChunk(chunk));
    WireChunk placed;
    placed.layer = chunk.layer;
    placed.head_begin = chunk.head_begin;
    placed.head_count = chunk.head_count;
    placed.token_begin = chunk.token_begin;
    placed.token_count = chunk.token_count;
    placed.placed = true;
    placed.placed_bytes = static_cast<int64_t>(chunk.payload_bytes());
    placed.crc32c = PlacedChecksum(*cache_, placed, kept_[chunk.layer]);
    placed_bytes_ += placed.placed_bytes;
    return stream_->OnChunk(std::move(placed));
  }
  absl::Status OnTrailer(const WireTrailer& trailer) override {
    return stream_->OnTrailer(trailer);
  }
  bool cancelled() const override { return stream_->cancelled(); }
  absl::string_view transport() const override { return "shm"; }
  // The rows written into the region, and the stream's messages.
  int64_t transport_bytes() const override {
    return stream_->transport_bytes() + placed_bytes_.load();
  }

 private:
  std::shared_ptr<KvStreamSink> stream_;
  const std::string name_;
  const size_t bytes_;
  const KvCacheShape shape_;
  std::unique_ptr<SharedRegion> region_;  // outlives cache_, which lies in it
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<KvAssembler> assembler_;
  std::vector<int> kept_;
  std::atomic<int64_t> placed_bytes_{0};
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
    std::shared_ptr<KvStreamSink> sink =
        std::make_shared<GrpcStreamSink>(stream, options.send_timeout);
    if (job.transport == KvTransport::kShm) {
      if (!options.serve_shm) {
        return absl::FailedPreconditionError(
            "this prefill node serves the grpc KV transport only (start it with --kv-transport "
            "grpc,shm to serve shm, on the decode node's host)");
      }
      sink = std::make_shared<RegionStreamSink>(std::move(sink), job);
    }
    return prefills->Submit(
        std::move(job), std::move(sink),
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
