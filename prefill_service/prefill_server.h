// The prefill node's gRPC front: serves kvwire.v1.Prefill by translating each request into
// a PrefillJob for a PrefillExecutor (the node's PrefillEngine, common/engine/
// prefill_engine.h) and the KV stream it writes back into PrefillResponse messages, with
// backpressure. It computes nothing itself.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/engine/prefill_engine.h"
#include "common/server/grpc_util.h"

namespace kvwire {

class Telemetry;

struct PrefillServerOptions {
  std::string listen = "0.0.0.0:0";  // port 0 picks a free port (see PrefillServer::port)
  size_t max_message_bytes = 64 << 20;
  ServerTls tls;
  Telemetry* telemetry = nullptr;  // counts requests refused before they reach the engine
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
