#include "decode_service/grpc_kv_source.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/server/trace_metadata.h"
#include "common/server/tsan.h"
#include "decode_service/translate.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

// Owns itself from StartCall until OnDone; the handle given to the engine outlives it.
class CallReactor final : public grpc::ClientReadReactor<v1::PrefillResponse> {
 public:
  struct Handle final : public KvTransfer {
    std::mutex mu;
    CallReactor* reactor = nullptr;  // null once done
    void Cancel() override {
      std::lock_guard<std::mutex> lock(mu);
      if (reactor) reactor->context_.TryCancel();
    }
  };

  CallReactor(std::shared_ptr<KvReceiver> receiver, std::shared_ptr<Handle> handle)
      : receiver_(std::move(receiver)), handle_(std::move(handle)) {}

  void Begin(v1::Prefill::Stub* stub, v1::PrefillRequest request,
             std::chrono::system_clock::time_point deadline, const TraceContext& trace,
             const std::string& authorization) {
    request_ = std::move(request);
    context_.set_deadline(deadline);
    if (!authorization.empty()) context_.AddMetadata("authorization", authorization);
    InjectTrace(trace, &context_);
    stub->async()->Prefill(&context_, &request_, this);
    StartRead(&msg_);
    HandOffToGrpc(this);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    TakeBackFromGrpc(this);
    if (!ok) return;  // the stream ended; OnDone follows
    wire_bytes_ += static_cast<int64_t>(msg_.ByteSizeLong());
    absl::Status st;
    switch (msg_.message_case()) {
      case v1::PrefillResponse::kHeader: {
        auto header = FromProto(msg_.header());
        st = header.ok() ? receiver_->OnHeader(*header) : header.status();
        break;
      }
      case v1::PrefillResponse::kChunk: {
        WireChunk chunk = FromProto(msg_.mutable_chunk());
        // shm, cuda_ipc: the rows the chunk stands for moved through the region or the pages
        // (checked by the receiver); its positions, if any, are in the message.
        if (chunk.placed && chunk.placed_bytes > 0) {
          wire_bytes_ += chunk.placed_bytes - static_cast<int64_t>(chunk.positions.size());
        }
        st = receiver_->OnChunk(std::move(chunk));
        break;
      }
      case v1::PrefillResponse::kTrailer:
        st = receiver_->OnTrailer(FromProto(msg_.trailer()));
        break;
      default:
        st = absl::InvalidArgumentError("malformed KV stream: an empty PrefillResponse");
    }
    if (!st.ok()) {
      if (error_.ok()) error_ = st;
      HandOffToGrpc(this);
      context_.TryCancel();
      return;
    }
    HandOffToGrpc(this);
    StartRead(&msg_);
  }

  void OnDone(const grpc::Status& status) override {
    TakeBackFromGrpc(this);
    {
      std::lock_guard<std::mutex> lock(handle_->mu);
      handle_->reactor = nullptr;
    }
    receiver_->OnDone(error_.ok() ? FromGrpcStatus(status) : error_, wire_bytes_);
    delete this;
  }

 private:
  std::shared_ptr<KvReceiver> receiver_;
  std::shared_ptr<Handle> handle_;
  grpc::ClientContext context_;
  v1::PrefillRequest request_;
  v1::PrefillResponse msg_;
  absl::Status error_;
  int64_t wire_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcKvSource>> GrpcKvSource::Create(
    const std::string& target, const ClientTls& tls, const std::string& auth_token,
    const Clock& clock, KvTransport transport, std::string pool_handle, size_t pool_bytes) {
  if (target.empty()) return absl::InvalidArgumentError("no prefill target (--prefill)");
  if ((transport == KvTransport::kCudaIpc) != !pool_handle.empty()) {
    return absl::InvalidArgumentError(
        "the cuda_ipc KV transport, and only it, takes the device pool's exported handle");
  }
  ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(tls));
  grpc::ChannelArguments args;
  args.SetLoadBalancingPolicyName("round_robin");
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxChunkBytesLimit + (1 << 20)));
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  // Reconnect quickly after a prefill node restarts.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // Keepalive, also between calls, and with no cap on pings while no data flows (a long
  // prefill sends nothing for a while); the prefill server accepts this rate.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  auto source = std::unique_ptr<GrpcKvSource>(new GrpcKvSource(clock));
  source->transport_ = transport;
  source->pool_handle_ = std::move(pool_handle);
  source->pool_bytes_ = pool_bytes;
  if (!auth_token.empty()) source->authorization_ = absl::StrCat("Bearer ", auth_token);
  source->channel_ = grpc::CreateCustomChannel(target, creds, args);
  source->stub_ = v1::Prefill::NewStub(source->channel_);
  return source;
}

absl::StatusOr<std::shared_ptr<KvTransfer>> GrpcKvSource::Start(
    PrefillJob job, std::shared_ptr<KvReceiver> receiver) {
  if (transport_ == KvTransport::kShm) {
    // The prefill node writes into the cache itself: it gets the region's name and the shape
    // that lays it out.
    KvCache* cache = receiver->destination();
    SharedRegion* region = cache ? cache->shared_region() : nullptr;
    if (region == nullptr) {
      return absl::FailedPreconditionError(
          "the shm KV transport writes into the decode cache, which must be in a shared host "
          "region (a host pool's AllocateShared)");
    }
    job.transport = KvTransport::kShm;
    job.region_name = region->name();
    job.region_bytes = region->size();
    job.region_shape = cache->shape();
  } else if (transport_ == KvTransport::kCudaIpc) {
    // The prefill node writes the rows into the cache's pages: it gets the pool's slab and
    // where the cache lies in it; the positions come on the stream.
    KvCache* cache = receiver->destination();
    auto place = cache != nullptr ? cache->paged_place()
                                  : absl::FailedPreconditionError("no destination cache");
    if (!place.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the cuda_ipc KV transport writes into the decode cache's pages of a device pool: ",
          place.status().message()));
    }
    job.transport = KvTransport::kCudaIpc;
    job.region_handle = pool_handle_;
    job.region_bytes = pool_bytes_;
    job.region_shape = cache->shape();
    job.region_place = *std::move(place);
  }
  auto handle = std::make_shared<CallReactor::Handle>();
  auto* reactor = new CallReactor(std::move(receiver), handle);
  {
    std::lock_guard<std::mutex> lock(handle->mu);
    handle->reactor = reactor;
  }
  reactor->Begin(stub_.get(), ToPrefillRequest(job), ToWallDeadline(clock_, job.deadline),
                 job.trace, authorization_);
  return std::shared_ptr<KvTransfer>(handle);
}

}  // namespace kvwire
