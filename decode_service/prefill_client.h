// The decode node's side of kvwire.v1.Prefill: one channel to the prefill nodes with
// gRPC client-side load balancing (round_robin over a list of addresses or a DNS name
// such as a Kubernetes headless Service), and asynchronous calls whose messages arrive,
// already translated to the wire's domain types, on gRPC threads.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "common/server/grpc_util.h"
#include "common/server/trace_metadata.h"
#include "common/wire/kv_wire.h"
#include "common/telemetry/telemetry.h"
#include "kvwire/v1/prefill.grpc.pb.h"

namespace kvwire {

// Called on gRPC threads, in stream order; they must not block. A non-OK status from a
// callback cancels the call and becomes its final status.
struct PrefillCallbacks {
  std::function<absl::Status(const WireHeader&)> on_header;
  std::function<absl::Status(const WireChunk&)> on_chunk;
  std::function<absl::Status(const WireTrailer&)> on_trailer;
  // Exactly once, last: the call's status and the serialized bytes of its messages.
  std::function<void(const absl::Status&, int64_t wire_bytes)> on_done;
};

// A call in flight; Cancel() may be called from any thread, any number of times.
class PrefillCall {
 public:
  virtual ~PrefillCall() = default;
  virtual void Cancel() = 0;
};

class PrefillClient {
 public:
  // `target`: "ipv4:10.0.0.1:50052,10.0.0.2:50052", "dns:///prefill.ns.svc:50052", or one
  // "host:port".
  static absl::StatusOr<std::unique_ptr<PrefillClient>> Create(const std::string& target,
                                                               const ClientTls& tls);
  std::shared_ptr<PrefillCall> Start(const v1::PrefillRequest& request,
                                     std::chrono::system_clock::time_point deadline,
                                     const TraceContext& trace, PrefillCallbacks callbacks);

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Prefill::Stub> stub_;
};

}  // namespace kvwire
