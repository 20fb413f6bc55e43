// GenerateRequest -> GenerationJob, the decode node's translation of its client API: every
// field checked (INVALID_ARGUMENT naming it), unset fields from the server's defaults. What
// needs the tokenizer (a text prompt's length, the two-stage policies' split) the engine
// does. A function of the request alone, so that it can be fuzzed (fuzz/).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/engine/decode_engine.h"
#include "common/model/llama_model.h"
#include "decode_service/decode_server.h"
#include "kvwire/v1/generation.pb.h"

namespace kvwire {

// `sequence` names a request that has no request_id ("<node>-<sequence>").
absl::StatusOr<GenerationJob> TranslateGenerateRequest(const v1::GenerateRequest& req,
                                                       const LlamaModel& model,
                                                       const DecodeServerOptions& options,
                                                       uint64_t sequence);

}  // namespace kvwire
