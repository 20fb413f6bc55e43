// What the two node binaries share around their servers: telemetry flags, waiting for
// SIGTERM/SIGINT, and --dry-run (flags checked, nothing started) for deployment checks.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/flags.h"
#include "common/telemetry.h"

namespace kvwire {

// --metrics-listen, --trace-file, --node-name, --grace-ms, --dry-run.
void DefineServerFlags(Flags& flags, const std::string& role, const std::string& metrics_default);
absl::StatusOr<std::unique_ptr<Telemetry>> TelemetryFromFlags(const Flags& flags,
                                                              const std::string& role);
// Blocks until SIGTERM or SIGINT, then calls `shutdown` (which should drain gracefully).
void WaitForTermination(const std::function<void()>& shutdown);

}  // namespace kvwire
