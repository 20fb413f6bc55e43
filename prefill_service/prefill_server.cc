#include "prefill_service/prefill_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/server/fault_watch.h"
#include "common/server/grpc_stream.h"
#include "common/server/trace_metadata.h"
#include "common/telemetry/telemetry.h"
#include "common/wire/kv_links.h"
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

// The sending end of a transport that writes into the decode node's cache (shm, cuda_ipc): each
// chunk stored where the cache lies by the receiving end's own assembler (KvAssembler, which
// checks and stores exactly as the decode node would), and only the chunk's rectangle (with its
// positions on cuda_ipc) and the checksum of what the cache now holds sent on the stream.
class PlacingStreamSink : public KvStreamSink {
 public:
  PlacingStreamSink(std::shared_ptr<KvStreamSink> stream, const PrefillJob& job)
      : stream_(std::move(stream)), shape_(job.region_shape), deadline_(job.deadline) {}

  absl::Status OnHeader(const WireHeader& h) override {
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
    ASSIGN_OR_RETURN(cache_, MapCache(h));
    WireExpectation expect = ExpectHeader(h);
    expect.max_chunk_bytes = kMaxChunkBytesLimit;
    assembler_ = std::make_unique<KvAssembler>(std::move(expect), cache_.get());
    RETURN_IF_ERROR(assembler_->OnHeader(h));
    kept_ = h.kept_per_layer;
    WireHeader out = h;
    RETURN_IF_ERROR(BeforeHeader(&out));
    return stream_->OnHeader(out);
  }
  absl::Status OnChunk(WireChunk chunk) override {
    if (assembler_ == nullptr) return absl::InternalError("a KV chunk before the header");
    if (stream_->cancelled()) return absl::CancelledError("the decode node went away");
    // The lease: past the deadline the decode node may have given the cache's memory to another
    // request (cuda_ipc's pages wait out exactly this), so nothing is written after it.
    if (Clock::Real().Now() > deadline_) {
      return absl::DeadlineExceededError(
          "the request's deadline passed: its decode cache is no longer this node's to write");
    }
    absl::StatusOr<WireChunk> placing = Place(chunk);
    if (!placing.ok()) {
      // A chunk that failed part-way may leave rows queued for the decode node's pages: they
      // land now, inside the lease, not at this thread's next wait.
      (void)Landed();
      return placing.status();
    }
    WireChunk placed = *std::move(placing);
    placed_bytes_ += placed.placed_bytes - static_cast<int64_t>(placed.positions.size());
    RETURN_IF_ERROR(BeforeChunk(*cache_, kept_[chunk.layer], &placed));
    RETURN_IF_ERROR(stream_->OnChunk(std::move(placed)));
    return AfterChunk();
  }
  absl::Status OnTrailer(const WireTrailer& trailer) override {
    // The rows have landed before the trailer tells the decode node to read them.
    RETURN_IF_ERROR(Landed());
    RETURN_IF_ERROR(stream_->OnTrailer(trailer));
    AfterTrailer();
    return absl::OkStatus();
  }
  bool cancelled() const override { return stream_->cancelled(); }
  // The rows written into the cache, and the stream's messages.
  int64_t transport_bytes() const override {
    return stream_->transport_bytes() + placed_bytes_.load();
  }

 protected:
  // The decode node's cache, laid out by the shape where it lies (or, nccl, a copy of it
  // here); what it lies in (a mapping) goes into mapping_.
  virtual absl::StatusOr<std::unique_ptr<KvCache>> MapCache(const WireHeader& h) = 0;
  // Whether the chunks carry their positions (the cache's are the decode node's host memory).
  virtual bool PositionsTravel() const = 0;
  // nccl's: the header names the link; a chunk's message gets its link fields before it is
  // sent, and its rows go on the link after it; a link goes back to the pool after a trailer.
  virtual absl::Status BeforeHeader(WireHeader* h) { return absl::OkStatus(); }
  virtual absl::Status BeforeChunk(const KvCache& cache, int kept, WireChunk* placed) {
    return absl::OkStatus();
  }
  virtual absl::Status AfterChunk() { return absl::OkStatus(); }
  virtual void AfterTrailer() {}

  std::shared_ptr<KvStreamSink> stream_;
  const KvCacheShape shape_;
  std::shared_ptr<void> mapping_;  // declared before cache_, so it outlives it

 private:
  // The chunk's rows written into the cache, and the chunk as the decode node gets it.
  absl::StatusOr<WireChunk> Place(const WireChunk& chunk) {
    RETURN_IF_ERROR(assembler_->OnChunk(chunk));
    return PlacedChunk(chunk, *cache_, kept_[chunk.layer], PositionsTravel());
  }
  // Once the rows this thread queued for a cache in device pages (cuda_ipc's) have landed: a
  // device orders nothing between this node's stream and the decode node's.
  absl::Status Landed() {
    if (cache_ == nullptr || cache_->host_rows()) return absl::OkStatus();
    return cache_->backend()->Synchronize();
  }

  const Clock::TimePoint deadline_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<KvAssembler> assembler_;
  std::vector<int> kept_;
  std::atomic<int64_t> placed_bytes_{0};
};

// shm: the decode node's cache is a shared region the request names, mapped from the header
// until the sink goes; rows and positions go into it.
class RegionStreamSink final : public PlacingStreamSink {
 public:
  RegionStreamSink(std::shared_ptr<KvStreamSink> stream, const PrefillJob& job)
      : PlacingStreamSink(std::move(stream), job),
        name_(job.region_name),
        bytes_(job.region_bytes) {}
  absl::string_view transport() const override { return "shm"; }

 private:
  absl::StatusOr<std::unique_ptr<KvCache>> MapCache(const WireHeader&) override {
    auto region = SharedRegion::Open(name_, bytes_);
    if (absl::IsNotFound(region.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          region.status().message(),
          ": the shm KV transport needs the prefill node on the decode node's host (and its "
          "/dev/shm); use grpc between hosts"));
    }
    RETURN_IF_ERROR(region.status());
    RegionAllocator memory(region->get());
    mapping_ = std::shared_ptr<SharedRegion>(*std::move(region));
    return KvCache::Create(shape_, memory);
  }
  bool PositionsTravel() const override { return false; }

  const std::string name_;
  const size_t bytes_;
};

// Decode nodes' device pools mapped into this node's backend (CUDA IPC), kept open between
// requests (opening one costs milliseconds, and a decode node sends every request to the same
// slab). A mapping no stream uses is closed after kIdle, or sooner when more than kMaxOpen are
// open: a decode node that restarted exports a new slab, and the old one's memory stays
// allocated while it is mapped here.
class ImportedPools {
 public:
  struct Pool {
    Pool(kernels::KernelBackend* backend, void* data) : backend(backend), data(data) {}
    ~Pool() { backend->CloseImported(data); }
    kernels::KernelBackend* const backend;
    void* const data;
  };
  explicit ImportedPools(std::shared_ptr<kernels::KernelBackend> backend)
      : backend_(std::move(backend)) {}

  absl::StatusOr<std::shared_ptr<Pool>> Get(const std::string& handle, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    const std::string key = absl::StrCat(bytes, ":", handle);
    for (auto it = pools_.begin(); it != pools_.end();) {
      const bool idle = it->second.pool.use_count() == 1;
      if (it->first != key && idle && (now - it->second.used > kIdle || pools_.size() > kMaxOpen)) {
        it = pools_.erase(it);
      } else {
        ++it;
      }
    }
    auto it = pools_.find(key);
    if (it == pools_.end()) {
      ASSIGN_OR_RETURN(void* data, backend_->ImportMemory(handle, bytes));
      it = pools_.emplace(key, Entry{std::make_shared<Pool>(backend_.get(), data), now}).first;
    }
    it->second.used = now;
    return it->second.pool;
  }

 private:
  static constexpr auto kIdle = std::chrono::seconds(60);
  static constexpr size_t kMaxOpen = 16;
  struct Entry {
    std::shared_ptr<Pool> pool;
    std::chrono::steady_clock::time_point used;
  };
  const std::shared_ptr<kernels::KernelBackend> backend_;
  std::mutex mu_;
  std::map<std::string, Entry> pools_;
};

// cuda_ipc: the decode node's cache is pages of its device pool, whose slab this node's backend
// maps; the rows go into the pages (copies into the mapping), the positions on the stream, and
// each chunk's checksum is computed on this GPU over what the pages hold.
class PagesStreamSink final : public PlacingStreamSink {
 public:
  PagesStreamSink(std::shared_ptr<KvStreamSink> stream, const PrefillJob& job,
                  std::shared_ptr<kernels::KernelBackend> backend, ImportedPools* pools)
      : PlacingStreamSink(std::move(stream), job),
        backend_(std::move(backend)),
        pools_(pools),
        handle_(job.region_handle),
        bytes_(job.region_bytes),
        place_(job.region_place) {}
  absl::string_view transport() const override { return "cuda_ipc"; }

 private:
  absl::StatusOr<std::unique_ptr<KvCache>> MapCache(const WireHeader&) override {
    auto pool = pools_->Get(handle_, bytes_);
    if (!pool.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "mapping the decode node's KV pool: ", pool.status().message(),
          " (cuda_ipc needs the prefill node on the decode node's host, on its GPU or one "
          "peered with it; use grpc otherwise)"));
    }
    auto cache = KvCache::CreatePagedView(shape_, backend_.get(),
                                          static_cast<uint8_t*>((*pool)->data), bytes_, place_);
    mapping_ = *std::move(pool);
    if (!cache.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("region: ", cache.status().message()));
    }
    return cache;
  }
  bool PositionsTravel() const override { return true; }

  const std::shared_ptr<kernels::KernelBackend> backend_;
  ImportedPools* const pools_;
  const std::string handle_;
  const size_t bytes_;
  const KvCache::PagedPlace place_;
};

// nccl: the decode node's cache is pages on another host, which this node's link (NCCL) sends
// to. The stream is assembled into a host cache of the same shape here (the engine hands host
// rows, and PlacedSpansOf's spans are the same on both nodes however each lays the cache out),
// each chunk's rows packed into one message that follows the chunk's on the link.
class LinkStreamSink final : public PlacingStreamSink {
 public:
  LinkStreamSink(std::shared_ptr<KvStreamSink> stream, const PrefillJob& job,
                 std::shared_ptr<SenderLinks> links, std::chrono::milliseconds send_timeout)
      : PlacingStreamSink(std::move(stream), job),
        links_(std::move(links)),
        peer_(job.link_peer),
        bytes_(job.region_bytes),
        place_(job.region_place),
        send_timeout_(send_timeout) {}
  absl::string_view transport() const override { return "nccl"; }

 private:
  absl::StatusOr<std::unique_ptr<KvCache>> MapCache(const WireHeader& h) override {
    // The pages are checked as cuda_ipc's are, against a slab of the decode node's size that
    // is never touched (the layout's arithmetic only).
    if (absl::Status st = KvCache::CheckPagedPlace(shape_, bytes_, place_); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("region: ", st.message()));
    }
    // A copy as small as the stream needs: its prompt tokens, and a coded cache's residual.
    KvCacheShape here = shape_;
    for (int l = 0; l < static_cast<int>(here.capacity.size()); ++l) {
      here.capacity[l] =
          std::min(here.capacity[l], std::max(1, h.kept_per_layer[l]) + here.appended);
    }
    ASSIGN_OR_RETURN(link_, links_->Acquire(peer_, &offer_));
    return KvCache::Create(here, HeapKvAllocator());
  }
  bool PositionsTravel() const override { return true; }
  absl::Status BeforeHeader(WireHeader* h) override {
    h->link_name = link_->name();
    h->link_offer = offer_;
    return absl::OkStatus();
  }
  absl::Status BeforeChunk(const KvCache& cache, int kept, WireChunk* placed) override {
    return links_->Prepare(*link_, cache, kept, placed, &message_);
  }
  absl::Status AfterChunk() override {
    if (stream_->cancelled()) {
      // The decode node may have read the chunk's message; the link is dropped either way.
      return absl::CancelledError("the decode node went away");
    }
    return links_->Send(*link_, message_, send_timeout_);
  }
  void AfterTrailer() override { links_->Release(peer_, std::move(link_)); }

  const std::shared_ptr<SenderLinks> links_;
  const std::string peer_;
  const size_t bytes_;
  const KvCache::PagedPlace place_;
  const std::chrono::milliseconds send_timeout_;
  std::unique_ptr<KvLink> link_;  // dropped (aborted) unless the stream ends whole
  std::string offer_;
  std::vector<uint8_t> message_;
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
  std::unique_ptr<ImportedPools> pools;  // serving cuda_ipc
  std::shared_ptr<SenderLinks> links;    // serving nccl
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  // After the server: destroyed first, so that it never touches a server that is gone.
  std::unique_ptr<FaultWatch> fault_watch;

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
    RETURN_IF_ERROR(fault_watch->Check());  // a faulted device: UNAVAILABLE, try another node
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
    } else if (job.transport == KvTransport::kCudaIpc) {
      if (pools == nullptr) {
        return absl::FailedPreconditionError(
            "this prefill node does not serve the cuda_ipc KV transport (start it on a GPU, "
            "--backend cuda, with cuda_ipc in --kv-transport, on the decode node's host)");
      }
      sink = std::make_shared<PagesStreamSink>(std::move(sink), job, options.device, pools.get());
    } else if (job.transport == KvTransport::kNccl) {
      if (links == nullptr) {
        return absl::FailedPreconditionError(
            "this prefill node does not serve the nccl KV transport (start it on a GPU, "
            "--backend cuda, with nccl in --kv-transport)");
      }
      sink = std::make_shared<LinkStreamSink>(std::move(sink), job, links, options.send_timeout);
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
  {
    std::shared_ptr<kernels::KernelBackend> backend = impl->options.backend;
    impl->fault_watch = std::make_unique<FaultWatch>(
        backend ? std::function<absl::Status()>([backend] { return backend->fault(); })
                : std::function<absl::Status()>(),
        impl->options.node_name);
  }
  const PrefillServerOptions& o = impl->options;
  if (o.max_request_bytes < 1024 || o.max_request_bytes > (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request size limit must be in [1KiB, 1GiB], got ", o.max_request_bytes, " bytes"));
  }
  if (o.send_timeout.count() < 1 || o.max_deadline.count() < 1) {
    return absl::InvalidArgumentError("the send timeout and the maximum deadline must be >= 1 ms");
  }
  if (o.device != nullptr) {
    if (o.device->host_addressable()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda_ipc writes into decode nodes' device pools, and this node's backend (",
                       kernels::BackendName(o.device->kind()), ") is the host's: --backend cuda"));
    }
    impl->pools = std::make_unique<ImportedPools>(o.device);
  }
  if (o.links != nullptr) {
    if (o.links->host_addressable()) {
      return absl::FailedPreconditionError(
          absl::StrCat("nccl sends from a GPU's memory, and this node's backend (",
                       kernels::BackendName(o.links->kind()), ") is the host's: --backend cuda"));
    }
    impl->links = std::make_shared<SenderLinks>(o.links.get());
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
  if (impl->server != nullptr) impl->fault_watch->Attach(impl->server.get());
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
