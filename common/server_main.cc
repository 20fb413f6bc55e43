#include "common/server_main.h"

#include <csignal>
#include <cstdio>

namespace kvwire {

void DefineServerFlags(Flags& flags, const std::string& role, const std::string& metrics_default) {
  flags.Define("node-name", role, "name of this node in metrics, traces and responses");
  flags.Define("metrics-listen", metrics_default,
               "address of the Prometheus /metrics endpoint (empty: none)");
  flags.Define("trace-file", "", "write spans as OTLP-JSON lines to this file ('-': stderr)");
  flags.Define("grace-ms", "20000", "on SIGTERM, how long in-flight requests may finish");
  flags.DefineBool("dry-run", "check the flags and exit without loading or serving");
}

absl::StatusOr<std::unique_ptr<Telemetry>> TelemetryFromFlags(const Flags& flags,
                                                              const std::string& role) {
  TelemetryOptions t;
  t.role = role;
  t.node = flags.GetString("node-name");
  t.metrics_listen = flags.GetString("metrics-listen");
  t.trace_file = flags.GetString("trace-file");
  return Telemetry::Create(t);
}

void WaitForTermination(const std::function<void()>& shutdown) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  sigwait(&set, &sig);
  std::fprintf(stderr, "received signal %d: draining\n", sig);
  shutdown();
}

}  // namespace kvwire
