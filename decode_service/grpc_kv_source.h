// The decode node's KvSource over the Prefill RPC: one channel to the prefill nodes with
// gRPC client-side load balancing (round_robin over a list of addresses or a DNS name such
// as a Kubernetes headless Service), and asynchronous calls whose messages reach the
// receiver already translated to the wire's domain types, on gRPC threads.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/clock.h"
#include "common/engine/kv_source.h"
#include "common/server/grpc_util.h"
#include "common/wire/kv_links.h"
#include "decode_service/prefill_router.h"
#include "kvwire/v1/prefill.grpc.pb.h"

namespace kvwire {

class GrpcKvSource final : public KvSource {
 public:
  // `target`: "ipv4:10.0.0.1:50052,10.0.0.2:50052", "dns:///prefill.ns.svc:50052", or one
  // "host:port". `auth_token`, when set, goes with every call as a bearer token. `clock` is
  // the decode engine's (deadlines are points on it).
  //
  // The channel pings each node (kKeepaliveMs): a node that stops answering fails its
  // calls, which the engine retries on another, and gets no new ones. A call that finds no
  // ready node fails at once (UNAVAILABLE) and the engine retries it after a backoff, up to
  // its --prefill-wait-ms: the wait for a node is the engine's, bounded and visible.
  //
  // `transport` kShm: the prefill nodes write the rows into each request's cache (a shared
  // region on this host, KvPool::AllocateShared), and the stream carries the rest. kCudaIpc:
  // they write the rows into the cache's pages of this node's device pool, whose slab of
  // `pool_bytes` they map by `pool_handle` (KernelBackend::ExportMemory). kNccl: they send the
  // rows on links (common/wire/kv_links.h) that this node joins on `device`, the backend of
  // its pool (a slab of `pool_bytes`), which receives them into the cache's pages.
  //
  // `affinity_tokens` > 0 routes each prefill by its prompt's first affinity_tokens tokens
  // (PrefillRouter: to the node whose prefix cache holds them), the round-robin channel taking
  // what the router cannot place; 0 balances round robin.
  static absl::StatusOr<std::unique_ptr<GrpcKvSource>> Create(
      const std::string& target, const ClientTls& tls, const std::string& auth_token = "",
      const Clock& clock = Clock::Real(), KvTransport transport = KvTransport::kGrpc,
      std::string pool_handle = "", size_t pool_bytes = 0, kernels::KernelBackend* device = nullptr,
      int affinity_tokens = 0);
  absl::string_view name() const override { return KvTransportName(transport_); }
  KvPlacement placement() const override { return PlacementOf(transport_); }
  bool leases_cache() const override { return transport_ == KvTransport::kCudaIpc; }
  absl::StatusOr<std::shared_ptr<KvTransfer>> Start(PrefillJob job,
                                                    std::shared_ptr<KvReceiver> receiver) override;

 private:
  explicit GrpcKvSource(const Clock& clock) : clock_(clock) {}
  const Clock& clock_;
  KvTransport transport_ = KvTransport::kGrpc;
  std::string pool_handle_;  // cuda_ipc
  size_t pool_bytes_ = 0;
  std::shared_ptr<ReceiverLinks> links_;   // nccl
  std::unique_ptr<PrefillRouter> router_;  // affinity routing
  std::string authorization_;              // "Bearer <token>", or empty
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Prefill::Stub> stub_;
};

}  // namespace kvwire
