// kvwire-prefill: the prefill node. Flags, the server, wait for SIGTERM, drain.
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/model/kv_pool.h"
#include "common/model/model_flags.h"
#include "common/server/server_main.h"
#include "prefill_service/prefill_server.h"

int main(int argc, char** argv) {
  using namespace kvwire;
  BlockTerminationSignals();
  LimitProtobufLogs();

  Flags flags;
  DefineModelFlags(flags);
  DefineServerFlags(flags, "prefill", "0.0.0.0:9101");
  flags.Define("listen", "0.0.0.0:50052", "gRPC address of the Prefill service");
  flags.Define("workers", "2",
               "prefills that run at once (they share the cores; more than one keeps a slow "
               "reader from holding the node)");
  flags.Define("max-queue", "16", "prefills that may wait; more is RESOURCE_EXHAUSTED");
  flags.Define("auth-token-file", "",
               "require 'authorization: Bearer <token>' with the token in this file (where TLS "
               "terminates outside the node)");
  flags.DefineBool("insecure",
                   "serve callers that neither mutual TLS nor a token authenticates on a "
                   "non-loopback address");
  flags.DefineBool("reflection", "enable gRPC server reflection");
  flags.Define("max-request-bytes", "0",
               "largest Prefill request (0: 4KiB + 5 bytes per token of the model's context)");
  flags.Define("send-timeout-ms", "10000",
               "cancel a stream whose reader takes no KV chunk for this long");
  flags.Define("max-deadline-s", "300", "longest a prefill may run, whatever its caller asks");
  flags.Define("prefix-cache-bytes", "0",
               "memory for the prefix cache: the full K/V of recent prompts' leading blocks, "
               "reused by prompts that start the same (0: none)");
  flags.Define("prefix-block-tokens", "64",
               "tokens per prefix cache block: prompts share cached K/V in whole blocks");
  flags.Define("kv-transport", "grpc",
               "KV transports served, comma-separated: grpc (always), shm (writing into the "
               "caches of decode nodes on this host), cuda_ipc (writing into the device pools "
               "of decode nodes on this host's GPUs; --backend cuda) and nccl (sending to decode "
               "nodes' GPUs on any host over NCCL; --backend cuda)");
  if (int rc = ParseFlagsOrExit(flags, "kvwire-prefill", "kvwire-prefill --model DIR [flags]", argc,
                                argv);
      rc >= 0) {
    return rc;
  }
  auto fail = [](const absl::Status& st) { return FailExit("kvwire-prefill", st); };
  PrefillServerOptions o;
  PrefillEngineOptions engine_options;
  o.listen = flags.GetString("listen");
  engine_options.node_name = flags.GetString("node-name");
  auto workers = flags.GetInt("workers", 1, 256);
  auto queue = flags.GetInt("max-queue", 1, 1 << 20);
  auto grace = flags.GetInt("grace-ms", 0, 3600000);
  auto request_bytes = ParseBytes(flags.GetString("max-request-bytes"));
  auto send_timeout = flags.GetInt("send-timeout-ms", 100, 3600000);
  auto max_deadline = flags.GetInt("max-deadline-s", 1, 86400);
  auto prefix_bytes = ParseBytes(flags.GetString("prefix-cache-bytes"));
  auto prefix_block = flags.GetInt("prefix-block-tokens", 1, 4096);
  for (const absl::Status& st :
       {workers.status(), queue.status(), grace.status(), request_bytes.status(),
        send_timeout.status(), max_deadline.status(), prefix_bytes.status(),
        prefix_block.status()}) {
    if (!st.ok()) return fail(st);
  }
  engine_options.prefix_cache_bytes = *prefix_bytes;
  engine_options.prefix_block_tokens = static_cast<int>(*prefix_block);
  engine_options.workers = static_cast<int>(*workers);
  engine_options.max_queue = static_cast<int>(*queue);
  o.tls = ServerTlsFromFlags(flags);
  o.send_timeout = std::chrono::milliseconds(*send_timeout);
  o.max_deadline = std::chrono::seconds(*max_deadline);
  o.reflection = flags.GetBool("reflection");
  o.insecure = flags.GetBool("insecure");
  bool serve_cuda_ipc = false, serve_nccl = false;
  for (absl::string_view name :
       absl::StrSplit(flags.GetString("kv-transport"), ',', absl::SkipEmpty())) {
    auto transport = ParseKvTransport(name);
    if (!transport.ok()) {
      return fail(absl::Status(transport.status().code(),
                               absl::StrCat("--kv-transport: ", transport.status().message())));
    }
    if (*transport == KvTransport::kShm) o.serve_shm = true;
    if (*transport == KvTransport::kCudaIpc) serve_cuda_ipc = true;
    if (*transport == KvTransport::kNccl) serve_nccl = true;
  }
  if (const std::string path = flags.GetString("auth-token-file"); !path.empty()) {
    auto token = ReadAuthToken(path);
    if (!token.ok()) return fail(token.status());
    o.auth_token = *token;
  }
  auto load_options = LoadOptionsFromFlags(flags);
  if (!load_options.ok()) return fail(load_options.status());
  if (flags.IsSet("decode-graphs")) {
    return fail(absl::InvalidArgumentError(
        "--decode-graphs: a prefill node does not decode (the flag is the decode node's)"));
  }
  if (absl::Status st = CheckServerAddresses(flags); !st.ok()) return fail(st);
  if (flags.GetBool("dry-run")) {
    std::printf("kvwire-prefill: flags OK (listen %s)\n", o.listen.c_str());
    return 0;
  }
  auto telemetry = TelemetryFromFlags(flags, "prefill");
  if (!telemetry.ok()) return fail(telemetry.status());
  o.telemetry = telemetry->get();
  engine_options.telemetry = telemetry->get();
  auto model = LlamaModel::Load(flags.GetString("model"), *load_options);
  if (!model.ok()) return fail(model.status());
  o.max_request_bytes = *request_bytes > 0
                            ? *request_bytes
                            : 4096 + 5 * static_cast<size_t>((*model)->config().context_limit());
  if (serve_cuda_ipc) o.device = (*model)->backend();
  if (serve_nccl) o.links = (*model)->backend();
  o.backend = (*model)->backend();
  o.node_name = engine_options.node_name;
  if (const ModelConfig& mc = (*model)->config(); engine_options.prefix_cache_bytes > 0) {
    const size_t block = PrefixCache::BlockBytes(mc.num_layers, mc.num_kv_heads * mc.head_dim,
                                                 engine_options.prefix_block_tokens);
    if (engine_options.prefix_cache_bytes < block) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("--prefix-cache-bytes ", engine_options.prefix_cache_bytes,
                       " holds no block: one of --prefix-block-tokens ",
                       engine_options.prefix_block_tokens, " takes ", block,
                       " bytes of this model (every layer's K and V in f32); 0 turns the "
                       "cache off")));
    }
  }
  PrefillEngine engine(model->get(), engine_options);
  auto server = PrefillServer::Start(&engine, o);
  if (!server.ok()) return fail(server.status());
  // The fingerprint goes to the operator's log (decode nodes must send the same), never to
  // a caller.
  std::fprintf(stderr,
               "kvwire-prefill %s: serving %s (model fingerprint %s) on port %d, metrics on port "
               "%d\n",
               engine_options.node_name.c_str(), (*model)->description().c_str(),
               (*model)->fingerprint().c_str(), (*server)->port(), (*telemetry)->metrics_port());
  WaitForTermination([&] {
    (*server)->Shutdown(static_cast<int>(*grace));
    engine.Shutdown();
  });
  return 0;
}
