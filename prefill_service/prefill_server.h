// The prefill node: serves kvwire.v1.Prefill. Each request runs on an engine-owned worker
// thread (never inside a gRPC reaction): the forward pass goes layer by layer, each
// layer's K/V is compressed by the request's policy and its chunks are queued on the
// stream while the next layer computes. Cancellation and deadlines are honoured between
// layers; a full queue is RESOURCE_EXHAUSTED.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/server/grpc_util.h"
#include "common/server/trace_metadata.h"
#include "common/model/llama_model.h"

namespace kvwire {

class Telemetry;

struct PrefillServerOptions {
  std::string listen = "0.0.0.0:0";  // port 0 picks a free port (see PrefillServer::port)
  std::string node_name = "prefill";
  int workers = 1;                   // prefills that run at once
  int max_queue = 16;                // prefills that may wait; more is RESOURCE_EXHAUSTED
  size_t max_message_bytes = 64 << 20;
  ServerTls tls;
  Telemetry* telemetry = nullptr;    // metrics and traces (null: none)

  // Fault injection for tests: called before each chunk is queued, with its index.
  std::function<void(int chunk_index)> testing_before_chunk;
  // Fault injection for tests: flips one payload byte of this chunk after checksumming.
  int testing_corrupt_chunk = -1;
};

class PrefillServer {
 public:
  // Starts serving `model` (which must outlive the server).
  static absl::StatusOr<std::unique_ptr<PrefillServer>> Start(LlamaModel* model,
                                                              PrefillServerOptions options);
  ~PrefillServer();

  int port() const;
  // Stops accepting, cancels in-flight streams after `grace_ms`, and stops the workers.
  void Shutdown(int grace_ms = 0);
  void Wait();

 private:
  struct Impl;
  explicit PrefillServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvwire
