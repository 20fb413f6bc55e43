// The decode node: serves kvwire.v1.Generation (the client API). It composes the domain
// parts (the KV pool, the KV sources: prefill nodes over gRPC and a local prefill engine
// for short prompts, and the decode engine, common/engine/decode_engine.h) and translates
// requests and responses; the engine does the work.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/compression/compression.h"
#include "common/engine/decode_engine.h"
#include "common/model/llama_model.h"
#include "common/server/grpc_util.h"
#include "common/sparse/attention.h"

namespace kvwire {

class Telemetry;

struct DecodeServerOptions {
  std::string listen = "0.0.0.0:0";
  std::string prefill_target;      // empty: every prompt prefills on this node
  ClientTls prefill_tls;           // to the prefill nodes (mutual TLS with a client cert)
  std::string prefill_auth_token;  // sent to the prefill nodes as a bearer token when set
  // Requests without a deadline, or with a later one, get this one.
  std::chrono::milliseconds max_deadline{3600 * 1000};
  ServerTls tls;  // for clients
  size_t kv_pool_bytes = size_t{1} << 30;
  size_t kv_page_bytes = 64 << 10;
  DecodeEngineOptions engine;
  // Server-side defaults for fields a request leaves unset, and limits.
  CompressionConfig default_compression;
  DecodeAttentionConfig default_attention;
  int default_max_tokens = 128;
  int max_tokens_limit = 4096;
  int max_prompt_tokens = 0;  // 0: the model's context
  size_t max_message_bytes = 4 << 20;
  Telemetry* telemetry = nullptr;
};

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
