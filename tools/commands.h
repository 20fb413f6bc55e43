// Commands of the kvwire tool. Each returns the process exit code: 0 success, 1 a failure
// reported on stderr, 2 a usage error.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/base/flags.h"
#include "common/compression/compression.h"
#include "common/compression/compression_flags.h"
#include "common/model/llama_model.h"
#include "common/model/model_flags.h"
#include "common/sparse/attention.h"

namespace kvwire::tools {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);
};

const std::vector<Command>& Commands();

int RunGenerate(int argc, char** argv);
int RunTokenize(int argc, char** argv);
int RunSelect(int argc, char** argv);
int RunEval(int argc, char** argv);
int RunPolicies(int argc, char** argv);
int RunTiming(int argc, char** argv);

// The compression (--policy and its parameters) and decode attention (--attention and its)
// the command line asks for, as generate and timing take them: `rocketkv` sets its own
// attention, so an --attention flag beside it is refused. `shared` as CompressionFromFlags.
absl::Status CompressionAndAttentionFromFlags(const Flags& flags,
                                              const std::set<std::string>& shared,
                                              CompressionConfig* compression,
                                              DecodeAttentionConfig* attention);

// Prints "kvwire COMMAND: message" and returns 1 (or 2 for InvalidArgument).
int Fail(const char* command, const absl::Status& status);

}  // namespace kvwire::tools
