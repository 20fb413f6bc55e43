#include "tools/commands.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvwire::tools {

const std::vector<Command>& Commands() {
  static const std::vector<Command>* commands = new std::vector<Command>{
      {"generate", "generate text from a prompt, streaming it to the terminal", RunGenerate},
      {"tokenize", "print the token ids of a text (and decode them back)", RunTokenize},
      {"select", "run a compression policy on q/k tensors from a safetensors file", RunSelect},
      {"eval", "fidelity and passkey evaluation of compression policies", RunEval},
  };
  return *commands;
}

int ParseFlagsOrExit(Flags& flags, const char* command, const char* usage, int argc, char** argv) {
  flags.DefineBool("help", "print this help");
  const absl::Status st = flags.Parse(argc, argv, 0);
  if (!st.ok()) {
    std::fprintf(stderr, "kvwire %s: %s\nusage: %s\n", command, std::string(st.message()).c_str(),
                 usage);
    return 2;
  }
  if (flags.GetBool("help")) {
    std::printf("usage: %s\n\nflags:\n%s", usage, flags.Help().c_str());
    return 0;
  }
  return -1;
}

int Fail(const char* command, const absl::Status& status) {
  std::fprintf(stderr, "kvwire %s: %s\n", command, std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace kvwire::tools
