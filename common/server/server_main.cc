#include "common/server/server_main.h"

#include <google/protobuf/stubs/logging.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {

void LimitProtobufLogs() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
        static std::mutex mu;
        static std::chrono::steady_clock::time_point window_start;
        static int lines = 0;
        static int64_t dropped = 0;
        std::string note;
        {
          std::lock_guard<std::mutex> lock(mu);
          const auto now = std::chrono::steady_clock::now();
          if (now - window_start >= std::chrono::minutes(1)) {
            window_start = now;
            lines = 0;
          }
          if (level != google::protobuf::LOGLEVEL_FATAL && ++lines > kProtobufLogBurst) {
            ++dropped;
            return;
          }
          if (dropped > 0) note = absl::StrCat(" (", dropped, " earlier protobuf lines dropped)");
          dropped = 0;
        }
        std::fprintf(stderr, "protobuf %s:%d: %s%s\n", file, line, message.c_str(), note.c_str());
      });
}

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int FailExit(const char* program, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s\n", program, std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& flag,
                                                 const std::string& value) {
  const size_t colon = value.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(value.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag,
                                                   " must be HOST:PORT with a port in "
                                                   "[0, 65535], got '",
                                                   value, "'"));
  }
  ListenAddress a{value.substr(0, colon), port};
  if (a.host.size() >= 2 && a.host.front() == '[' && a.host.back() == ']') {
    a.host = a.host.substr(1, a.host.size() - 2);
  }
  return a;
}

absl::Status CheckServerAddresses(const Flags& flags) {
  RETURN_IF_ERROR(ParseListenAddress("listen", flags.GetString("listen")).status());
  if (flags.GetString("metrics-listen").empty()) return absl::OkStatus();
  return ParseListenAddress("metrics-listen", flags.GetString("metrics-listen")).status();
}

void DefineServerFlags(Flags& flags, const std::string& role, const std::string& metrics_default) {
  flags.Define("node-name", role, "name of this node in metrics, traces and responses");
  flags.Define("metrics-listen", metrics_default,
               "address of the Prometheus /metrics endpoint (empty: none)");
  flags.Define("trace-file", "", "write spans as OTLP-JSON lines to this file ('-': stderr)");
  flags.Define("grace-ms", "20000", "on SIGTERM, how long in-flight requests may finish");
  flags.DefineBool("dry-run", "check the flags and exit without loading or serving");
  flags.Define("tls-cert", "", "server certificate chain (PEM); enables TLS");
  flags.Define("tls-key", "", "server private key (PEM)");
  flags.Define("tls-client-ca", "", "require client certificates signed by this CA (mutual TLS)");
}

ServerTls ServerTlsFromFlags(const Flags& flags) {
  return {flags.GetString("tls-cert"), flags.GetString("tls-key"),
          flags.GetString("tls-client-ca")};
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
