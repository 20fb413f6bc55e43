// The decode node's settings: its listener, prefill nodes, KV pool and engine, and the
// defaults and limits its request translation (translate.h) applies. Apart from the server
// so that the translation builds without gRPC (fuzz/).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "common/compression/compression.h"
#include "common/engine/decode_engine.h"
#include "common/server/tls_options.h"
#include "common/sparse/attention.h"

namespace kvwire {

class Telemetry;

inline constexpr int kMaxStreamInterval = 1024;

struct DecodeServerOptions {
  std::string listen = "0.0.0.0:0";
  std::string prefill_target;  // empty: every prompt prefills on this node
  // Prefill node by the prompt's first prefill_affinity_tokens tokens
  // (--prefill-affinity-tokens: to the node whose prefix cache holds them), or round robin (0).
  int prefill_affinity_tokens = 0;
  // How the prefill nodes' K/V rows come (--kv-transport): on the stream (grpc), or written
  // into the cache by a prefill node on this host (shm: a host backend's pool; cuda_ipc: a
  // device backend's).
  KvTransport kv_transport = KvTransport::kGrpc;
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
  // Tokens per streamed message after the first (vLLM's and SGLang's --stream-interval):
  // 1 streams every token as it comes; more sends fewer, larger messages.
  int stream_interval = 1;
  Telemetry* telemetry = nullptr;
};

}  // namespace kvwire
