// What the two node binaries share around their servers: telemetry flags, waiting for
// SIGTERM/SIGINT, and --dry-run (flags checked, nothing started) for deployment checks.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/flags.h"
#include "common/server/tls_options.h"
#include "common/telemetry/telemetry.h"

namespace kvwire {

// Blocks SIGTERM and SIGINT in this thread and every thread it starts after, so that
// WaitForTermination receives them. Call first thing in main().
void BlockTerminationSignals();
// Protobuf logs a line for every string field with invalid UTF-8 that it parses, so each
// such request would write one: at most kProtobufLogBurst lines a minute pass, and the
// next line that does says how many were dropped. Call once, in main().
inline constexpr int kProtobufLogBurst = 10;
void LimitProtobufLogs();

// Prints "PROGRAM: message" and returns the exit code: 2 for a usage error
// (InvalidArgument), 1 otherwise.
int FailExit(const char* program, const absl::Status& status);

// A listen address, HOST:PORT with a port in [0, 65535]; the brackets of "[::1]:80" are
// removed from `host`, which may be empty (":80"). InvalidArgument naming --`flag` otherwise.
struct ListenAddress {
  std::string host;
  int port = 0;
};
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& flag, const std::string& value);

// --listen and (when set) --metrics-listen are HOST:PORT with a port in [0, 65535].
absl::Status CheckServerAddresses(const Flags& flags);

// --metrics-listen, --trace-file, --node-name, --grace-ms, --dry-run, and the server's own TLS:
// --tls-cert, --tls-key, --tls-client-ca.
void DefineServerFlags(Flags& flags, const std::string& role, const std::string& metrics_default);
// The server TLS the flags DefineServerFlags defined ask for.
ServerTls ServerTlsFromFlags(const Flags& flags);
absl::StatusOr<std::unique_ptr<Telemetry>> TelemetryFromFlags(const Flags& flags,
                                                              const std::string& role);
// Blocks until SIGTERM or SIGINT, then calls `shutdown` (which should drain gracefully).
void WaitForTermination(const std::function<void()>& shutdown);

}  // namespace kvwire
