// PrefillRequest -> PrefillJob, the prefill node's translation of the internal API: every
// field parsed; the engine checks them against the model (PrefillEngine::Submit). The
// call's deadline and trace context are the server's to add. A function of the request
// alone, so that it can be fuzzed (fuzz/).
#pragma once

#include "absl/status/statusor.h"
#include "common/engine/prefill_job.h"
#include "kvwire/v1/prefill.pb.h"

namespace kvwire {

absl::StatusOr<PrefillJob> TranslatePrefillRequest(const v1::PrefillRequest& req);

}  // namespace kvwire
