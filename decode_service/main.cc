// kvwire-decode: the decode node. Flags, the server, wait for SIGTERM, drain.
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/compression/compression_flags.h"
#include "common/model/model_flags.h"
#include "common/server/grpc_util.h"
#include "common/server/server_main.h"
#include "common/sparse/attention.h"
#include "decode_service/decode_server.h"

namespace kvwire {
namespace {

absl::StatusOr<DecodeServerOptions> OptionsFromFlags(const Flags& f) {
  DecodeServerOptions o;
  o.listen = f.GetString("listen");
  o.prefill_target = f.GetString("prefill");
  auto transport = ParseKvTransport(f.GetString("kv-transport"));
  if (!transport.ok()) {
    return absl::Status(transport.status().code(),
                        absl::StrCat("--kv-transport: ", transport.status().message()));
  }
  o.kv_transport = *transport;
  if (o.kv_transport != KvTransport::kGrpc && o.prefill_target.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-transport ", KvTransportName(o.kv_transport),
        " moves K/V from prefill nodes, and --prefill names none (every prompt prefills here)"));
  }
  ASSIGN_OR_RETURN(int64_t affinity, f.GetInt("prefill-affinity-tokens", 0, 1 << 20));
  if (affinity > 0 && o.prefill_target.empty()) {
    return absl::InvalidArgumentError(
        "--prefill-affinity-tokens routes among prefill nodes, and --prefill names none");
  }
  o.prefill_affinity_tokens = static_cast<int>(affinity);
  o.prefill_tls = {f.GetString("prefill-tls-ca"), f.GetString("prefill-tls-cert"),
                   f.GetString("prefill-tls-key"), f.GetString("prefill-tls-server-name")};
  o.tls = ServerTlsFromFlags(f);
  ASSIGN_OR_RETURN(o.kv_pool_bytes, ParseBytes(f.GetString("kv-pool-bytes")));
  ASSIGN_OR_RETURN(o.kv_page_bytes, ParseBytes(f.GetString("kv-page-bytes")));
  o.engine.node_name = f.GetString("node-name");
  ASSIGN_OR_RETURN(int64_t batch, f.GetInt("max-batch", 1, 4096));
  ASSIGN_OR_RETURN(int64_t queue, f.GetInt("max-queue", 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t timeout, f.GetInt("queue-timeout-ms", 0, 3600000));
  ASSIGN_OR_RETURN(int64_t attempts, f.GetInt("prefill-attempts", 1, 16));
  ASSIGN_OR_RETURN(int64_t attempt_timeout, f.GetInt("prefill-attempt-timeout-ms", 100, 3600000));
  ASSIGN_OR_RETURN(int64_t prefill_wait, f.GetInt("prefill-wait-ms", 0, 3600000));
  ASSIGN_OR_RETURN(int64_t max_deadline, f.GetInt("max-deadline-s", 1, 7 * 86400));
  if (const std::string path = f.GetString("prefill-auth-token-file"); !path.empty()) {
    ASSIGN_OR_RETURN(o.prefill_auth_token, ReadAuthToken(path));
  }
  o.engine.prefill_attempt_timeout_ms = static_cast<int>(attempt_timeout);
  o.engine.prefill_wait_ms = static_cast<int>(prefill_wait);
  o.max_deadline = std::chrono::seconds(max_deadline);
  ASSIGN_OR_RETURN(int64_t local, f.GetInt("local-prefill-below", 0, 1 << 30));
  ASSIGN_OR_RETURN(size_t chunk, ParseBytes(f.GetString("max-chunk-bytes")));
  o.engine.max_batch = static_cast<int>(batch);
  o.engine.max_queue = static_cast<int>(queue);
  o.engine.queue_timeout_ms = static_cast<int>(timeout);
  o.engine.prefill_attempts = static_cast<int>(attempts);
  o.engine.local_prefill_below = static_cast<int>(local);
  o.engine.max_chunk_bytes = chunk;
  ASSIGN_OR_RETURN(o.default_compression, CompressionFromFlags(f));
  ASSIGN_OR_RETURN(o.default_attention, AttentionFromFlags(f));
  ASSIGN_OR_RETURN(int64_t def_max, f.GetInt("default-max-tokens", 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t max_limit, f.GetInt("max-tokens-limit", 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t max_prompt, f.GetInt("max-prompt-tokens", 0, 1 << 30));
  ASSIGN_OR_RETURN(o.max_message_bytes, ParseBytes(f.GetString("max-message-bytes")));
  o.default_max_tokens = static_cast<int>(def_max);
  o.max_tokens_limit = static_cast<int>(max_limit);
  o.max_prompt_tokens = static_cast<int>(max_prompt);
  ASSIGN_OR_RETURN(int64_t interval, f.GetInt("stream-interval", 1, kMaxStreamInterval));
  o.stream_interval = static_cast<int>(interval);
  if (o.prefill_target.empty() && o.engine.local_prefill_below == 0) {
    o.engine.local_prefill_below = 1 << 30;  // no prefill nodes: everything is local
  }
  return o;
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) {
  using namespace kvwire;
  BlockTerminationSignals();
  LimitProtobufLogs();

  Flags flags;
  DefineModelFlags(flags);
  DefineCompressionFlags(flags);
  DefineKvFormatFlag(flags);
  DefineServerFlags(flags, "decode", "0.0.0.0:9102");
  flags.Define("listen", "0.0.0.0:50051", "gRPC address of the Generation service");
  flags.Define("prefill", "",
               "prefill nodes: ipv4:HOST:PORT,HOST:PORT or dns:///NAME:PORT (round-robin "
               "balanced); empty: prefill every prompt here");
  flags.Define("prefill-affinity-tokens", "0",
               "route each prefill by the prompt's first N tokens, on a consistent-hash ring of "
               "the prefill nodes, so that prompts that start the same reach the node whose "
               "prefix cache holds them (the prefill nodes' --prefix-block-tokens); 0: round "
               "robin");
  flags.Define("kv-transport", "grpc",
               "how the prefill nodes' K/V rows come: grpc (on the Prefill stream, any hosts), "
               "shm (written into this node's cache by a prefill node on this host; a CPU "
               "backend), cuda_ipc (written into this node's device pool by a prefill node on "
               "a GPU of this host; --backend cuda) or nccl (received into this node's device "
               "pool from prefill nodes' GPUs on any host over NCCL; --backend cuda)");
  flags.Define("prefill-tls-ca", "", "CA that signed the prefill nodes' certificates (TLS)");
  flags.Define("prefill-tls-cert", "", "this node's client certificate (mutual TLS)");
  flags.Define("prefill-tls-key", "", "this node's client key (mutual TLS)");
  flags.Define("prefill-tls-server-name", "", "name to check in the prefill certificates");
  flags.Define("kv-pool-bytes", "1GiB", "KV cache memory for all sequences");
  flags.Define("kv-page-bytes", "64KiB", "allocation granularity of the KV pool");
  flags.Define("max-batch", "32", "sequences prefilling or decoding at once");
  flags.Define("max-queue", "64", "requests that may wait for admission");
  flags.Define("queue-timeout-ms", "30000", "longest wait for KV pool room");
  flags.Define("prefill-attempts", "3", "tries of a failed prefill, on other nodes");
  flags.Define("prefill-attempt-timeout-ms", "60000",
               "a prefill attempt running longer has failed (and is retried)");
  flags.Define("prefill-wait-ms", "30000",
               "how long an admitted request waits for room while every prefill node is full");
  flags.Define("prefill-auth-token-file", "",
               "send the token in this file to the prefill nodes (their --auth-token-file)");
  flags.Define("max-deadline-s", "3600", "deadline of requests that set none (or a later one)");
  flags.Define("local-prefill-below", "0", "prefill prompts shorter than this here");
  flags.Define("max-chunk-bytes", "1MiB", "largest KV chunk the prefill node may send");
  DefineAttentionFlags(flags);
  flags.Define("default-max-tokens", "128", "max_tokens when a request sets none");
  flags.Define("max-tokens-limit", "4096", "largest max_tokens a request may ask");
  flags.Define("max-prompt-tokens", "0", "longest prompt accepted (0: the model's context)");
  flags.Define("max-message-bytes", "4MiB", "largest request message accepted");
  flags.Define("stream-interval", "1",
               "tokens per streamed message after the first, which goes at once (vLLM's and "
               "SGLang's --stream-interval); what is left goes with the last message");
  if (int rc = ParseFlagsOrExit(flags, "kvwire-decode",
                                "kvwire-decode --model DIR --prefill TARGET [flags]", argc, argv);
      rc >= 0) {
    return rc;
  }
  auto fail = [](const absl::Status& st) { return FailExit("kvwire-decode", st); };
  auto options = OptionsFromFlags(flags);
  if (!options.ok()) return fail(options.status());
  auto grace = flags.GetInt("grace-ms", 0, 3600000);
  if (!grace.ok()) return fail(grace.status());
  auto load_options = LoadOptionsFromFlags(flags);
  if (!load_options.ok()) return fail(load_options.status());
  if (absl::Status st = CheckServerAddresses(flags); !st.ok()) return fail(st);
  if (flags.GetBool("dry-run")) {
    std::printf("kvwire-decode: flags OK (listen %s, prefill '%s')\n", options->listen.c_str(),
                options->prefill_target.c_str());
    return 0;
  }
  auto telemetry = TelemetryFromFlags(flags, "decode");
  if (!telemetry.ok()) return fail(telemetry.status());
  options->telemetry = telemetry->get();
  auto model = LlamaModel::Load(flags.GetString("model"), *load_options);
  if (!model.ok()) return fail(model.status());
  auto server = DecodeServer::Start(model->get(), *options);
  if (!server.ok()) return fail(server.status());
  std::fprintf(stderr, "kvwire-decode %s: serving %s on port %d, metrics on port %d, prefill %s\n",
               options->engine.node_name.c_str(), (*model)->description().c_str(),
               (*server)->port(), (*telemetry)->metrics_port(),
               options->prefill_target.empty() ? "local" : options->prefill_target.c_str());
  WaitForTermination([&] { (*server)->Shutdown(static_cast<int>(*grace)); });
  return 0;
}
