// Passkey retrieval through a running deployment: every prompt, method and budget is one
// Generation.Generate call (to the router, or a decode node) with the method's compression
// and decode attention in the request, greedy, `answer length` tokens, end-of-sequence
// ignored. What is measured is what prefill → wire → decode delivers; the answers must
// equal the in-process evaluation's prompt for prompt (ComparePasskey).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/server/grpc_util.h"
#include "tools/passkey.h"

namespace kvwire::tools {

struct RemoteOptions {
  std::string target;  // host:port of the router or a decode node
  ClientTls tls;       // plaintext when tls.ca_file is empty
  int concurrency = 1;
  int timeout_ms = 120000;  // per request
  int connect_timeout_ms = 10000;
  // Each request twice in a row, cold then warm (the second may find the prompt in its prefill
  // node's prefix cache): both TTFTs, and the warm answer, which must equal the cold one.
  bool warm_pass = false;
};

absl::StatusOr<PasskeyRun> EvalPasskeyRemote(const RemoteOptions& options,
                                             const std::vector<EvalPrompt>& prompts,
                                             const std::vector<EvalMethod>& methods,
                                             const std::vector<int>& budgets,
                                             const std::function<void(int, int)>& progress);

}  // namespace kvwire::tools
