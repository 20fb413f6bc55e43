// The prefill node's gRPC front: serves kvwire.v1.Prefill by translating each request into
// a PrefillJob for a PrefillExecutor (the node's PrefillEngine, common/engine/
// prefill_engine.h) and the KV stream it writes back into PrefillResponse messages, with
// backpressure. It computes nothing itself.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/engine/prefill_engine.h"
#include "common/server/grpc_util.h"

namespace kvwire {

class Telemetry;

struct PrefillServerOptions {
  std::string listen = "0.0.0.0:0";  // port 0 picks a free port (see PrefillServer::port)
  // Largest request accepted; a request is a prompt's token ids and a few parameters, so
  // kvwire-prefill sets 4 KiB plus 5 bytes (the longest varint) per token of the context.
  size_t max_request_bytes = 64 << 10;
  // A stream whose reader takes no KV chunk for this long is cancelled and its worker freed.
  std::chrono::milliseconds send_timeout{10000};
  // The longest a prefill may run, whatever deadline (or none) its caller set.
  std::chrono::milliseconds max_deadline{300000};
  bool reflection = false;  // gRPC server reflection (advertises the service)
  // Set: every call must carry "authorization: Bearer <token>" (for meshes where TLS
  // terminates outside the node); others get UNAUTHENTICATED and nothing else.
  std::string auth_token;
  // On an address other than loopback the node refuses to serve K/V to unauthenticated
  // callers: it needs mutual TLS (tls.client_ca_file) or auth_token, or this set.
  bool insecure = false;
  ServerTls tls;
  Telemetry* telemetry = nullptr;  // counts requests refused before they reach the engine
  // KV transports served (--kv-transport); grpc always. A request for another is refused with
  // FAILED_PRECONDITION. cuda_ipc: the model's device backend, into which decode nodes' pools on
  // this host are mapped (null: not served).
  bool serve_shm = false;
  std::shared_ptr<kernels::KernelBackend> device;
  // nccl: the device backend whose links (KernelBackend::OpenLink) send to decode nodes
  // (null: not served).
  std::shared_ptr<kernels::KernelBackend> links;
  // The model's backend, whose fault (KernelBackend::fault) takes the node out of service
  // (common/server/fault_watch.h); null: not watched.
  std::shared_ptr<kernels::KernelBackend> backend;
  std::string node_name = "prefill";  // in a refusal after a fault
};

class PrefillServer {
 public:
  // Starts serving prefills on `prefills` (which must outlive the server).
  static absl::StatusOr<std::unique_ptr<PrefillServer>> Start(PrefillExecutor* prefills,
                                                              PrefillServerOptions options);
  ~PrefillServer();

  int port() const;
  // Stops accepting and cancels in-flight streams after `grace_ms` (their prefills stop at
  // the next layer).
  void Shutdown(int grace_ms = 0);
  void Wait();

 private:
  struct Impl;
  explicit PrefillServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvwire
