// The model flags every kvwire program shares: --model, --dtype, --threads, --backend.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/base/flags.h"
#include "common/model/llama_model.h"

namespace kvwire {

void DefineModelFlags(Flags& flags);
absl::StatusOr<std::unique_ptr<LlamaModel>> LoadModelFromFlags(const Flags& flags);
// The model flags' values, checked without loading anything (for --dry-run).
absl::StatusOr<LoadOptions> LoadOptionsFromFlags(const Flags& flags);

}  // namespace kvwire
