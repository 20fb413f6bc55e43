// Flags that several kvwire programs share: the model to load and the compression policy
// with its parameters (the tools' flags and the servers' defaults).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/compression/compression.h"
#include "common/base/flags.h"
#include "common/model/llama_model.h"
#include "common/sparse/sparse_attention.h"

namespace kvwire {

// --model, --dtype, --threads, --backend.
void DefineModelFlags(Flags& flags);
absl::StatusOr<std::unique_ptr<LlamaModel>> LoadModelFromFlags(const Flags& flags);
// The model flags' values, checked without loading anything (for --dry-run).
absl::StatusOr<LoadOptions> LoadOptionsFromFlags(const Flags& flags);
// --policy, --budget, --ratio, --window, --kernel, --pool, --gqa, ... (and --seed unless
// already defined).
void DefineCompressionFlags(Flags& flags);
absl::StatusOr<CompressionConfig> CompressionFromFlags(const Flags& flags);
// --attention, --attention-budget, --attention-k, --attention-r, --attention-page.
void DefineAttentionFlags(Flags& flags);
absl::StatusOr<DecodeAttentionConfig> AttentionFromFlags(const Flags& flags);

}  // namespace kvwire
