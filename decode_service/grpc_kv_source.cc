#include "decode_service/grpc_kv_source.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/server/trace_metadata.h"
#include "common/server/tsan.h"
#include "decode_service/translate.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

// Threads that receive nccl chunks from their links, outside gRPC's reactions: a chunk's
// receive may wait for another stream's turn on its link, so each chunk gets a thread that is
// idle (or about to be) or a new one, never one that may be waiting, and the threads stay for
// later chunks, since a backend keeps state per thread (the CUDA backend's lanes: streams,
// tables, staging). As many as receives have waited at once; process-wide and never
// destroyed, as gRPC's own threads.
class ReceiveThreads {
 public:
  static ReceiveThreads& Get() {
    static auto* threads = new ReceiveThreads;
    return *threads;
  }
  // Queues `task`; refused only where no thread can be started for it.
  absl::Status Run(absl::AnyInvocable<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    if (free_ < tasks_.size()) {  // every queued task has a thread of its own to take it
      try {
        std::thread([this] { Work(); }).detach();
      } catch (const std::system_error& e) {
        tasks_.pop_back();
        return absl::ResourceExhaustedError(
            absl::StrCat("no thread to receive an nccl chunk on: ", e.what()));
      }
      ++free_;
    }
    ready_.notify_one();
    return absl::OkStatus();
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ready_.wait(lock, [&] { return !tasks_.empty(); });
      absl::AnyInvocable<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      --free_;
      lock.unlock();
      task();
      lock.lock();
      ++free_;
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<absl::AnyInvocable<void()>> tasks_;
  size_t free_ = 0;  // threads not in a task (waiting, or started and not yet waiting)
};

// Owns itself from StartCall until OnDone; the handle given to the engine outlives it.
class CallReactor final : public grpc::ClientReadReactor<v1::PrefillResponse> {
 public:
  struct Handle final : public KvTransfer {
    std::mutex mu;
    CallReactor* reactor = nullptr;  // null once done
    std::string node_, route_;       // set before the engine sees the handle
    void Cancel() override {
      std::lock_guard<std::mutex> lock(mu);
      if (reactor) reactor->context_.TryCancel();
    }
    std::string node() const override { return node_; }
    std::string route() const override { return route_; }
  };

  CallReactor(std::shared_ptr<KvReceiver> receiver, std::shared_ptr<Handle> handle,
              KvTransport transport, std::shared_ptr<ReceiverLinks> links)
      : receiver_(std::move(receiver)),
        handle_(std::move(handle)),
        transport_(transport),
        links_(std::move(links)) {}

  // `keep` holds what the stub needs (and the routed node's load) until the call is done.
  void Begin(v1::Prefill::Stub* stub, std::shared_ptr<const void> keep, v1::PrefillRequest request,
             std::chrono::system_clock::time_point deadline, const TraceContext& trace,
             const std::string& authorization) {
    keep_ = std::move(keep);
    request_ = std::move(request);
    context_.set_deadline(deadline);
    if (!authorization.empty()) context_.AddMetadata("authorization", authorization);
    InjectTrace(trace, &context_);
    stub->async()->Prefill(&context_, &request_, this);
    // nccl: reads are restarted from a receiving thread (OnReadDone), outside the reactions.
    if (transport_ == KvTransport::kNccl) AddHold();
    StartRead(&msg_);
    HandOffToGrpc(this);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    TakeBackFromGrpc(this);
    if (!ok) {  // the stream ended; OnDone follows
      EndReads();
      return;
    }
    wire_bytes_ += static_cast<int64_t>(msg_.ByteSizeLong());
    absl::Status st;
    switch (msg_.message_case()) {
      case v1::PrefillResponse::kHeader: {
        auto header = FromProto(msg_.header());
        st = header.status();
        if (st.ok()) st = UseLink(*header);
        if (st.ok()) st = receiver_->OnHeader(*header);
        break;
      }
      case v1::PrefillResponse::kChunk: {
        WireChunk chunk = FromProto(msg_.mutable_chunk());
        // shm, cuda_ipc, nccl: the rows the chunk stands for moved through the region, the
        // pages or the link (checked by the receiver); its positions, if any, are in the message.
        if (chunk.placed && chunk.placed_bytes > 0) {
          wire_bytes_ += chunk.placed_bytes - static_cast<int64_t>(chunk.positions.size());
        }
        if (transport_ == KvTransport::kNccl) {
          // Not on this thread: the receive may wait for the turn of another stream on the
          // link, whose own OnReadDone needs one of the few threads gRPC runs every reaction
          // of the process on (a shared callback queue in Debian's 1.51); blocking them all
          // in such waits stalls the stream that holds the turn.
          st = ReceiveThreads::Get().Run([this, chunk = std::move(chunk)]() mutable {
            absl::Status received = ReceiveRows(chunk);
            if (received.ok()) received = receiver_->OnChunk(std::move(chunk));
            Continue(received);  // the last use of `this` in the task
          });
          if (st.ok()) return;
          break;
        }
        st = ReceiveRows(chunk);
        if (st.ok()) st = receiver_->OnChunk(std::move(chunk));
        break;
      }
      case v1::PrefillResponse::kTrailer:
        st = receiver_->OnTrailer(FromProto(msg_.trailer()));
        whole_ = st.ok();
        break;
      default:
        st = absl::InvalidArgumentError("malformed KV stream: an empty PrefillResponse");
    }
    Continue(st);
  }

  void OnDone(const grpc::Status& status) override {
    TakeBackFromGrpc(this);
    {
      std::lock_guard<std::mutex> lock(handle_->mu);
      handle_->reactor = nullptr;
    }
    if (link_ != nullptr) links_->Done(link_, whole_);
    keep_.reset();  // the node's load drops before the engine may retry
    receiver_->OnDone(error_.ok() ? FromGrpcStatus(status) : error_, wire_bytes_);
    delete this;
  }

 private:
  // The next read, or the call cancelled with `st`'s error. Touches nothing after it: the
  // next OnReadDone, or OnDone, may already run (a call without the hold can end at the cancel).
  void Continue(const absl::Status& st) {
    const bool held = transport_ == KvTransport::kNccl;
    if (!st.ok() && error_.ok()) error_ = st;
    HandOffToGrpc(this);
    if (st.ok()) {
      StartRead(&msg_);
      return;
    }
    context_.TryCancel();
    if (held) RemoveHold();  // no more reads: OnDone may follow
  }
  // The stream ended (a read came back empty): nccl's hold (Begin) goes, and OnDone follows.
  void EndReads() {
    if (transport_ != KvTransport::kNccl) return;
    HandOffToGrpc(this);
    RemoveHold();
  }
  // nccl: the link the header names (joined when it offers one). Link fields on a stream of
  // another transport are malformed.
  absl::Status UseLink(const WireHeader& h) {
    if (transport_ != KvTransport::kNccl) {
      if (h.link_name.empty() && h.link_offer.empty()) return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrCat("malformed KV stream: the header names an nccl link on a ",
                       KvTransportName(transport_), " stream"));
    }
    if (link_ != nullptr) return absl::OkStatus();  // a second header: the receiver refuses it
    ASSIGN_OR_RETURN(link_, links_->Use(h.link_name, h.link_offer));
    kept_ = h.kept_per_layer;
    return absl::OkStatus();
  }
  // nccl: the chunk checked as the stream's next, then its rows received into the cache from
  // the link (bounded: kLinkWait for its turn and as much for the bytes).
  absl::Status ReceiveRows(const WireChunk& c) {
    if (transport_ != KvTransport::kNccl) {
      if (c.link_seq == 0 && c.link_bytes == 0) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat("malformed KV stream: a chunk of layer ",
                                                     c.layer,
                                                     " says its rows are on an nccl link "
                                                     "of a ",
                                                     KvTransportName(transport_), " stream"));
    }
    RETURN_IF_ERROR(receiver_->CheckChunk(c));  // the rectangle is the next, inside the cache
    if (link_ == nullptr || receiver_->destination() == nullptr) {
      return absl::InternalError("an nccl chunk with no link or destination");
    }
    return links_->Receive(*link_, c, *receiver_->destination(), kept_[c.layer], kLinkWait);
  }
  // Generous: a new link's first receive waits for NCCL to set the communicator up.
  static constexpr std::chrono::milliseconds kLinkWait{30000};

  std::shared_ptr<KvReceiver> receiver_;
  std::shared_ptr<Handle> handle_;
  std::shared_ptr<const void> keep_;
  const KvTransport transport_;
  const std::shared_ptr<ReceiverLinks> links_;
  std::shared_ptr<KvLink> link_;
  std::vector<int> kept_;
  bool whole_ = false;  // the trailer was taken: the link is where both ends think it is
  grpc::ClientContext context_;
  v1::PrefillRequest request_;
  v1::PrefillResponse msg_;
  absl::Status error_;
  int64_t wire_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcKvSource>> GrpcKvSource::Create(
    const std::string& target, const ClientTls& tls, const std::string& auth_token,
    const Clock& clock, KvTransport transport, std::string pool_handle, size_t pool_bytes,
    kernels::KernelBackend* device, int affinity_tokens) {
  if (target.empty()) return absl::InvalidArgumentError("no prefill target (--prefill)");
  if ((transport == KvTransport::kCudaIpc) != !pool_handle.empty()) {
    return absl::InvalidArgumentError(
        "the cuda_ipc KV transport, and only it, takes the device pool's exported handle");
  }
  if (transport == KvTransport::kNccl && (device == nullptr || device->host_addressable())) {
    return absl::FailedPreconditionError(
        "the nccl KV transport receives into a device pool: it needs the pool's device backend");
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
  if (transport == KvTransport::kNccl) source->links_ = std::make_shared<ReceiverLinks>(device);
  if (!auth_token.empty()) source->authorization_ = absl::StrCat("Bearer ", auth_token);
  source->channel_ = grpc::CreateCustomChannel(target, creds, args);
  source->stub_ = v1::Prefill::NewStub(source->channel_);
  if (affinity_tokens > 0) {
    // A node's channel names its address: TLS checks the certificate against the name the
    // target gave (a Service's), unless a name is set.
    grpc::ChannelArguments node_args = args;
    if (tls.server_name.empty() && !absl::StartsWith(target, "ipv4:")) {
      std::string host = absl::StartsWith(target, "dns:///") ? target.substr(7) : target;
      host = host.substr(0, host.rfind(':'));
      node_args.SetSslTargetNameOverride(host);
    }
    ASSIGN_OR_RETURN(source->router_,
                     PrefillRouter::Create(
                         target, affinity_tokens, [creds, node_args](const std::string& address) {
                           return grpc::CreateCustomChannel(address, creds, node_args);
                         }));
  }
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
  } else if (transport_ == KvTransport::kCudaIpc || transport_ == KvTransport::kNccl) {
    // The rows go into the cache's pages of this node's device pool: cuda_ipc's prefill node
    // writes them there itself (it gets the pool's slab), nccl's sends them on a link to this
    // node, which receives them there (it gets this node's name: links are per decode node);
    // either gets where the cache lies, and the positions come on the stream.
    KvCache* cache = receiver->destination();
    auto place = cache != nullptr ? cache->paged_place()
                                  : absl::FailedPreconditionError("no destination cache");
    if (!place.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the ", KvTransportName(transport_),
                       " KV transport moves the rows into the decode cache's pages of a device "
                       "pool: ",
                       place.status().message()));
    }
    job.transport = transport_;
    if (transport_ == KvTransport::kCudaIpc) {
      job.region_handle = pool_handle_;
    } else {
      job.link_peer = links_->peer();
    }
    job.region_bytes = pool_bytes_;
    job.region_shape = cache->shape();
    job.region_place = *std::move(place);
  }
  // Affinity: the node the prompt's leading tokens map to, the next one on a retry.
  PrefillRouter::Pick pick;
  if (router_ != nullptr) pick = router_->Route(router_->Key(job.prompt_ids), job.attempt);
  v1::Prefill::Stub* stub = pick.stub != nullptr ? pick.stub : stub_.get();
  auto handle = std::make_shared<CallReactor::Handle>();
  handle->node_ = pick.node;
  handle->route_ = pick.stub != nullptr ? pick.route : "round_robin";
  auto* reactor = new CallReactor(std::move(receiver), handle, transport_, links_);
  {
    std::lock_guard<std::mutex> lock(handle->mu);
    handle->reactor = reactor;
  }
  reactor->Begin(stub, std::move(pick.keep), ToPrefillRequest(job),
                 ToWallDeadline(clock_, job.deadline), job.trace, authorization_);
  return std::shared_ptr<KvTransfer>(handle);
}

}  // namespace kvwire
