// The decode node: serves kvwire.v1.Generation (the client API). It composes the domain
// parts (the KV pool, the KV sources: prefill nodes over gRPC and a local prefill engine
// for short prompts, and the decode engine, common/engine/decode_engine.h) and translates
// requests and responses; the engine does the work.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/engine/decode_engine.h"
#include "common/model/llama_model.h"
#include "decode_service/decode_options.h"

namespace kvwire {

class DecodeServer {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeServer>> Start(LlamaModel* model,
                                                             DecodeServerOptions options);
  ~DecodeServer();

  int port() const;
  KvPool& pool();
  DecodeEngine& engine();
  // Graceful: health NOT_SERVING, refuse new requests, let running ones finish within
  // `grace_ms`, then stop.
  void Shutdown(int grace_ms = 0);
  void Wait();

 private:
  struct Impl;
  explicit DecodeServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvwire
