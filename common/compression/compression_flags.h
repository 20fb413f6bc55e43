// The compression flags of the kvwire programs (`kvwire generate/select/eval`, the decode
// node's defaults), defined from the policy registry: --policy, the shared --budget,
// --ratio, --window, --skip-layers, and every policy's own parameters (--kernel,
// --kernel-small, --chunk, --groups, ...). A parameter flag given for a policy that does
// not take it is an error naming the flag.
#pragma once

#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/flags.h"
#include "common/compression/compression.h"

namespace kvwire {

// "kernel_small" → "kernel-small".
std::string ParamFlagName(absl::string_view param);

// Defines the flags (a parameter flag another part of the program already defined, such as
// `generate`'s sampler --seed, is shared rather than redefined).
void DefineCompressionFlags(Flags& flags);
// --kv-format, for the programs that send or receive a cache (the decode node, `kvwire
// generate` and `timing`; `kvwire eval` has --kv-formats).
void DefineKvFormatFlag(Flags& flags);
// The same without --policy, --budget and --ratio (for commands that take policies and
// budgets in lists, like `kvwire eval`).
void DefineCompressionParamFlags(Flags& flags);

// The configuration the command line asks for. Flags in `shared` (defined for another
// purpose too) are passed to the policy only when it takes them, never rejected.
absl::StatusOr<CompressionConfig> CompressionFromFlags(const Flags& flags,
                                                       const std::set<std::string>& shared = {});

// The compression values set on the command line, by parameter name (policy included),
// for callers that apply them themselves (the eval harness applies them per method).
ParamValues CompressionValuesFromFlags(const Flags& flags);

// An error from ApplyCompressionValues with its parameters named as flags
// ("kernel_small must ..." → "--kernel-small must ...").
absl::Status AsFlagError(const absl::Status& status);

}  // namespace kvwire
