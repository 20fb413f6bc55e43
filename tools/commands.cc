#include "tools/commands.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire::tools {

const std::vector<Command>& Commands() {
  static const std::vector<Command>* commands = new std::vector<Command>{
      {"generate", "generate text from a prompt, streaming it to the terminal", RunGenerate},
      {"tokenize", "print the token ids of a text (and decode them back)", RunTokenize},
      {"select", "run a compression policy on q/k tensors from a safetensors file", RunSelect},
      {"eval", "fidelity and passkey evaluation of compression policies", RunEval},
      {"policies",
       "list the compression policies and decode attention modes, with their parameters",
       RunPolicies},
      {"timing", "prefill and decode wall times of greedy generation from token ids, as JSON",
       RunTiming},
  };
  return *commands;
}

int Fail(const char* command, const absl::Status& status) {
  std::fprintf(stderr, "kvwire %s: %s\n", command, std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace kvwire::tools
