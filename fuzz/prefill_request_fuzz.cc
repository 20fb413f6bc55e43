// Fuzzes the prefill node's translation of the internal API: bytes parsed as a
// kvwire.v1.PrefillRequest (as the Prefill method parses them), TranslatePrefillRequest,
// then the prefill engine's check of the job against the synthetic tiny model
// (PrefillEngine::Check, which Run applies first). A refusal must be a status with a
// message; a job the engine accepts must keep the check's promises and, when its prompt is
// short, prefill into a cache through the receiving side's checks. The model fingerprint is
// the first thing checked, so a job is checked twice: as it came, and with the model's own
// fingerprint, which the rest of the check and the prefill then see.
#include <google/protobuf/stubs/logging.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "fuzz/request_fuzz.h"
#include "kvwire/v1/prefill.pb.h"
#include "prefill_service/translate.h"

namespace kvwire::fuzz {
namespace {

void ExpectRefusal(const absl::Status& st, absl::string_view what) {
  if (st.message().empty() || (st.code() != absl::StatusCode::kInvalidArgument &&
                               st.code() != absl::StatusCode::kFailedPrecondition)) {
    Fail(what, " refused with ", st.ToString(), " (expected INVALID_ARGUMENT or ",
         "FAILED_PRECONDITION with a message)");
  }
}

// What PrefillEngine::Check promises of a job it accepts (common/engine/prefill_engine.cc).
void CheckAccepted(const PrefillJob& job) {
  LlamaModel& model = TinyModel();
  const ModelConfig& mc = model.config();
  const int len = static_cast<int>(job.prompt_ids.size());
  if (job.model_fingerprint && *job.model_fingerprint != model.fingerprint()) {
    Fail("accepted another model's fingerprint");
  }
  if (len < 1 || len > mc.context_limit()) Fail("accepted a prompt of ", len, " tokens");
  for (int32_t id : job.prompt_ids) {
    if (id < 0 || id >= mc.vocab_size) Fail("accepted prompt id ", id);
  }
  if (!job.compression.Validate().ok() ||
      !job.compression.ValidateFor(mc.num_layers, mc.head_dim).ok() ||
      !job.compression.policy->selects()) {
    Fail("accepted compression ", job.compression.Describe());
  }
  if (job.max_chunk_bytes < 1024 || job.max_chunk_bytes > kMaxChunkBytesLimit) {
    Fail("accepted max_chunk_bytes ", job.max_chunk_bytes);
  }
  const kernels::SamplingParams& s = job.sampling;
  // No more than the decode node accepts (decode_service/translate.cc).
  if (!std::isfinite(s.temperature) || s.temperature < 0 || s.temperature > 100 ||
      !(s.top_p > 0 && s.top_p <= 1) || s.top_k < 0) {
    Fail("accepted sampling temperature ", s.temperature, ", top_p ", s.top_p, ", top_k ", s.top_k);
  }
  for (int l = 0; l < mc.num_layers; ++l) {
    const int kept = job.compression.KeptTokens(l, len);
    if (kept < 1 || kept > len) Fail("layer ", l, " would keep ", kept, " of ", len, " tokens");
  }
}

void Run(const uint8_t* data, size_t size) {
  v1::PrefillRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;
  auto job = TranslatePrefillRequest(req);
  if (!job.ok()) {
    Note("translated: ", job.status().ToString());
    ExpectRefusal(job.status(), "the translation");
    return;
  }
  PrefillEngine& engine = TinyPrefillEngine();
  const absl::Status as_sent = engine.Check(*job);
  Note("checked: ", as_sent.ToString());
  if (!as_sent.ok()) {
    ExpectRefusal(as_sent, "the engine");
  } else {
    CheckAccepted(*job);
  }
  job->model_fingerprint = TinyModel().fingerprint();
  if (absl::Status st = engine.Check(*job); !st.ok()) {
    ExpectRefusal(st, "the engine");
    return Note("checked with the model's fingerprint: ", st.ToString());
  }
  CheckAccepted(*job);
  RunAcceptedPrefill(*job, job->compression, /*extra_tokens=*/4);
}

}  // namespace
}  // namespace kvwire::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs every string field that is not UTF-8; the parse failing is enough.
  google::protobuf::SetLogHandler(nullptr);
  kvwire::fuzz::TinyPrefillEngine();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvwire::fuzz::Run(data, size);
  return 0;
}
