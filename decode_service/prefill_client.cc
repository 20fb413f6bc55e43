#include "decode_service/prefill_client.h"

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

// Owns itself from StartCall until OnDone; the handle given to the engine outlives it.
class CallReactor final : public grpc::ClientReadReactor<v1::PrefillResponse> {
 public:
  struct Handle final : public PrefillCall {
    std::mutex mu;
    CallReactor* reactor = nullptr;  // null once done
    void Cancel() override {
      std::lock_guard<std::mutex> lock(mu);
      if (reactor) reactor->context_.TryCancel();
    }
  };

  CallReactor(PrefillCallbacks callbacks, std::shared_ptr<Handle> handle)
      : callbacks_(std::move(callbacks)), handle_(std::move(handle)) {}

  void Begin(v1::Prefill::Stub* stub, const v1::PrefillRequest& request,
             std::chrono::system_clock::time_point deadline, const TraceContext& trace) {
    request_ = request;
    context_.set_deadline(deadline);
    InjectTrace(trace, &context_);
    stub->async()->Prefill(&context_, &request_, this);
    StartRead(&msg_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    wire_bytes_ += static_cast<int64_t>(msg_.ByteSizeLong());
    absl::Status st;
    switch (msg_.message_case()) {
      case v1::PrefillResponse::kHeader: {
        auto header = FromProto(msg_.header());
        st = header.ok() ? callbacks_.on_header(*header) : header.status();
        break;
      }
      case v1::PrefillResponse::kChunk:
        st = callbacks_.on_chunk(FromProto(msg_.mutable_chunk()));
        break;
      case v1::PrefillResponse::kTrailer:
        st = callbacks_.on_trailer(FromProto(msg_.trailer()));
        break;
      default:
        st = absl::InvalidArgumentError("malformed KV stream: an empty PrefillResponse");
    }
    if (!st.ok()) {
      if (error_.ok()) error_ = st;
      context_.TryCancel();
      return;
    }
    StartRead(&msg_);
  }

  void OnDone(const grpc::Status& status) override {
    {
      std::lock_guard<std::mutex> lock(handle_->mu);
      handle_->reactor = nullptr;
    }
    absl::Status st = error_.ok() ? FromGrpcStatus(status) : error_;
    callbacks_.on_done(st, wire_bytes_);
    delete this;
  }

 private:
  PrefillCallbacks callbacks_;
  std::shared_ptr<Handle> handle_;
  grpc::ClientContext context_;
  v1::PrefillRequest request_;
  v1::PrefillResponse msg_;
  absl::Status error_;
  int64_t wire_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillClient>> PrefillClient::Create(const std::string& target,
                                                                     const ClientTls& tls) {
  if (target.empty()) return absl::InvalidArgumentError("no prefill target (--prefill)");
  ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(tls));
  grpc::ChannelArguments args;
  args.SetLoadBalancingPolicyName("round_robin");
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxChunkBytesLimit + (1 << 20)));
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  // Reconnect quickly after a prefill node restarts.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  auto client = std::unique_ptr<PrefillClient>(new PrefillClient());
  client->channel_ = grpc::CreateCustomChannel(target, creds, args);
  client->stub_ = v1::Prefill::NewStub(client->channel_);
  return client;
}

std::shared_ptr<PrefillCall> PrefillClient::Start(const v1::PrefillRequest& request,
                                                  std::chrono::system_clock::time_point deadline,
                                                  const TraceContext& trace,
                                                  PrefillCallbacks callbacks) {
  auto handle = std::make_shared<CallReactor::Handle>();
  auto* reactor = new CallReactor(std::move(callbacks), handle);
  {
    std::lock_guard<std::mutex> lock(handle->mu);
    handle->reactor = reactor;
  }
  reactor->Begin(stub_.get(), request, deadline, trace);
  return handle;
}

}  // namespace kvwire
