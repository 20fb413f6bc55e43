// GenerateRequest -> GenerationJob, the decode node's translation of its client API: every
// field checked (INVALID_ARGUMENT naming it), unset fields from the server's defaults. What
// needs the tokenizer (a text prompt's length, the two-stage policies' split) the engine
// does. And PrefillJob -> PrefillRequest, what the node asks of a prefill node. Functions
// of the request alone, built without the gRPC server, so that they can be fuzzed (fuzz/).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/engine/decode_engine.h"
#include "common/engine/prefill_job.h"
#include "common/model/llama_model.h"
#include "decode_service/decode_options.h"
#include "kvwire/v1/generation.pb.h"
#include "kvwire/v1/prefill.pb.h"

namespace kvwire {

// `sequence` names a request that has no request_id ("<node>-<sequence>").
absl::StatusOr<GenerationJob> TranslateGenerateRequest(const v1::GenerateRequest& req,
                                                       const LlamaModel& model,
                                                       const DecodeServerOptions& options,
                                                       uint64_t sequence);

// The Prefill RPC's request for `job` (GrpcKvSource sends it; the prefill node translates
// it back with TranslatePrefillRequest). The deadline and trace context go as metadata.
v1::PrefillRequest ToPrefillRequest(const PrefillJob& job);

}  // namespace kvwire
