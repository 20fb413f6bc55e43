// kvwire-prefill: the prefill node. Flags, the server, wait for SIGTERM, drain.
#include <cstdio>

#include "common/model/model_flags.h"
#include "common/server/server_main.h"
#include "prefill_service/prefill_server.h"

int main(int argc, char** argv) {
  using namespace kvwire;
  BlockTerminationSignals();

  Flags flags;
  DefineModelFlags(flags);
  DefineServerFlags(flags, "prefill", "0.0.0.0:9101");
  flags.Define("listen", "0.0.0.0:50052", "gRPC address of the Prefill service");
  flags.Define("workers", "1", "prefills that run at once");
  flags.Define("max-queue", "16", "prefills that may wait; more is RESOURCE_EXHAUSTED");
  flags.Define("tls-cert", "", "server certificate chain (PEM); enables TLS");
  flags.Define("tls-key", "", "server private key (PEM)");
  flags.Define("tls-client-ca", "", "require client certificates signed by this CA (mutual TLS)");
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
  for (const absl::Status& st : {workers.status(), queue.status(), grace.status()}) {
    if (!st.ok()) return fail(st);
  }
  engine_options.workers = static_cast<int>(*workers);
  engine_options.max_queue = static_cast<int>(*queue);
  o.tls = {flags.GetString("tls-cert"), flags.GetString("tls-key"),
           flags.GetString("tls-client-ca")};
  auto load_options = LoadOptionsFromFlags(flags);
  if (!load_options.ok()) return fail(load_options.status());
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
  PrefillEngine engine(model->get(), engine_options);
  auto server = PrefillServer::Start(&engine, o);
  if (!server.ok()) return fail(server.status());
  std::fprintf(stderr, "kvwire-prefill %s: serving %s on port %d, metrics on port %d\n",
               engine_options.node_name.c_str(), (*model)->description().c_str(), (*server)->port(),
               (*telemetry)->metrics_port());
  WaitForTermination([&] {
    (*server)->Shutdown(static_cast<int>(*grace));
    engine.Shutdown();
  });
  return 0;
}
