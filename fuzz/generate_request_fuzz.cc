// Fuzzes the decode node's translation of its client API: bytes parsed as a
// kvwire.v1.GenerateRequest (as the Generate method parses them), then
// TranslateGenerateRequest against the synthetic tiny model with the server's default
// options. A refused request must be INVALID_ARGUMENT with a message. An accepted job must
// keep every promise the translation makes (bounds of the prompt, max_tokens, sampling,
// stop strings and ids, a compression and decode attention valid for the model), and then
// go on as the decode engine takes it (DecodeEngine::Prepare): the text prompt tokenized,
// a two-stage policy resolved, the cache and the selector sized and made; and what the node
// would send a prefill node (ToPrefillRequest, serialized and parsed back) must be accepted
// by the prefill node's translation and engine, and, for short prompts, prefill.
#include <google/protobuf/stubs/logging.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/compression/compression.h"
#include "common/sparse/attention.h"
#include "common/sparse/rocketkv.h"
#include "decode_service/translate.h"
#include "fuzz/request_fuzz.h"
#include "kvwire/v1/generation.pb.h"
#include "prefill_service/translate.h"

namespace kvwire::fuzz {
namespace {

constexpr uint64_t kSequence = 7;

// What TranslateGenerateRequest promises of an accepted job (decode_service/translate.cc).
void CheckTranslated(const v1::GenerateRequest& req, const GenerationJob& j,
                     const DecodeServerOptions& options) {
  const ModelConfig& mc = TinyModel().config();
  const int max_prompt =
      options.max_prompt_tokens > 0 ? options.max_prompt_tokens : mc.context_limit();
  if (j.request_id.empty() || j.request_id.size() > 256) {
    Fail("request_id of ", j.request_id.size(), " bytes");
  }
  if (j.prompt_text.empty() == j.prompt_ids.empty()) {
    Fail("the job needs exactly one of a text prompt and prompt ids");
  }
  if (j.prompt_text.size() > static_cast<size_t>(max_prompt) * 32) {
    Fail("a text prompt of ", j.prompt_text.size(), " bytes");
  }
  if (static_cast<int>(j.prompt_ids.size()) > max_prompt) {
    Fail(j.prompt_ids.size(), " prompt ids");
  }
  for (int32_t id : j.prompt_ids) {
    if (id < 0 || id >= mc.vocab_size) Fail("prompt id ", id, " outside the vocabulary");
  }
  if (j.max_tokens < 1 || j.max_tokens > options.max_tokens_limit) {
    Fail("max_tokens ", j.max_tokens);
  }
  const kernels::SamplingParams& s = j.sampling;
  if (!std::isfinite(s.temperature) || s.temperature < 0 || s.temperature > 100 ||
      !(s.top_p > 0 && s.top_p <= 1) || s.top_k < 0) {
    Fail("sampling temperature ", s.temperature, ", top_p ", s.top_p, ", top_k ", s.top_k);
  }
  if (j.stop.size() > 16) Fail(j.stop.size(), " stop strings");
  for (const std::string& stop : j.stop) {
    if (stop.empty() || stop.size() > 256) Fail("a stop string of ", stop.size(), " bytes");
  }
  const size_t eos = req.sampling().ignore_eos() ? 0 : mc.eos_token_ids.size() + 1;
  if (j.stop_ids.size() > 64 + eos) Fail(j.stop_ids.size(), " stop ids");
  for (int32_t id : j.stop_ids) {
    if (id < 0 || id >= mc.vocab_size) Fail("stop id ", id, " outside the vocabulary");
  }
  if (absl::Status st = j.compression.Validate(); !st.ok()) {
    Fail("accepted compression ", j.compression.Describe(), ": ", st.ToString());
  }
  if (absl::Status st = j.compression.ValidateFor(mc.num_layers, mc.head_dim); !st.ok()) {
    Fail("accepted compression ", j.compression.Describe(), ": ", st.ToString());
  }
  if (j.compression.policy->selects()) {
    if (absl::Status st = j.attention.Validate(); !st.ok()) {
      Fail("accepted attention ", j.attention.Describe(), ": ", st.ToString());
    }
    if (j.attention.top_r > mc.head_dim) Fail("attention top_r ", j.attention.top_r);
  } else if (j.attention.mode != AttentionMode::kDense) {
    Fail(j.compression.policy_name(), " with attention ", j.attention.Describe());
  }
}

// The decode engine's preparation of an accepted job (DecodeEngine::Prepare, StartPrefill).
void Prepare(GenerationJob& j) {
  LlamaModel& model = TinyModel();
  const ModelConfig& mc = model.config();
  if (j.prompt_ids.empty()) {
    auto ids = model.tokenizer().Encode(j.prompt_text);
    if (!ids.ok()) return Note("not tokenized: ", ids.status().ToString());
    for (int32_t id : *ids) {
      if (id < 0 || id >= mc.vocab_size) Fail("the tokenizer gave id ", id);
    }
    if (ids->empty()) return;
    j.prompt_ids = *std::move(ids);
  }
  const int len = static_cast<int>(j.prompt_ids.size());
  if (absl::Status st =
          ResolveTwoStage(&j.compression, &j.attention, len, j.max_tokens, mc.head_dim);
      !st.ok()) {
    if (st.code() != absl::StatusCode::kInvalidArgument) {
      Fail("resolving ", j.compression.Describe(), ": ", st.ToString());
    }
    return Note("not resolved: ", st.ToString());
  }
  if (!j.compression.policy->selects()) Fail(j.compression.Describe(), " left unresolved");
  if (absl::Status st = j.compression.ValidateFor(mc.num_layers, mc.head_dim); !st.ok()) {
    Fail("resolved compression ", j.compression.Describe(), ": ", st.ToString());
  }
  if (absl::Status st = j.attention.Validate(); !st.ok()) {
    Fail("resolved attention ", j.attention.Describe(), ": ", st.ToString());
  }
  if (len + j.max_tokens > mc.context_limit()) return Note("beyond the context");

  const KvCacheShape shape =
      CompressedCacheShape(j.compression, mc, model.kv_dtype(), len, j.max_tokens);
  for (int capacity : shape.capacity) {
    if (capacity < 1 || capacity > len + j.max_tokens) Fail("cache capacity ", capacity);
  }
  if (auto bytes = DecodeSelectorBytes(j.attention, mc, shape); !bytes.ok()) {
    return Note("no selector: ", bytes.status().ToString());
  }
  auto selector = MakeDecodeSelector(j.attention, mc, shape, HeapKvAllocator());
  if (!selector.ok()) {
    Fail("attention ", j.attention.Describe(),
         " sized but not made: ", selector.status().ToString());
  }

  // What the node asks of a prefill node, through the wire and the prefill node's checks.
  PrefillJob pj;
  pj.request_id = j.request_id;
  pj.prompt_ids = j.prompt_ids;
  pj.compression = j.compression;
  pj.model_fingerprint = model.fingerprint();
  pj.max_chunk_bytes = DecodeEngineOptions().max_chunk_bytes;
  pj.sampling = j.sampling;
  pj.seed = j.seed;
  v1::PrefillRequest sent;
  if (!sent.ParseFromString(ToPrefillRequest(pj).SerializeAsString())) {
    Fail("a PrefillRequest that does not parse back");
  }
  auto received = TranslatePrefillRequest(sent);
  if (!received.ok()) {
    Fail("the prefill node refuses what the decode node sends (", pj.compression.Describe(),
         "): ", received.status().ToString());
  }
  if (received->compression.Describe() != pj.compression.Describe()) {
    Fail("compression ", pj.compression.Describe(), " arrives as ",
         received->compression.Describe());
  }
  if (absl::Status st = TinyPrefillEngine().Check(*received); !st.ok()) {
    Fail("the prefill engine refuses what the decode node sends (", pj.compression.Describe(), ", ",
         len, " tokens): ", st.ToString());
  }
  RunAcceptedPrefill(*received, pj.compression, j.max_tokens);
}

void Run(const uint8_t* data, size_t size) {
  static const DecodeServerOptions options;
  v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;
  auto job = TranslateGenerateRequest(req, TinyModel(), options, kSequence);
  Note("translated: ", job.status().ToString());
  if (!job.ok()) {
    if (job.status().code() != absl::StatusCode::kInvalidArgument ||
        job.status().message().empty()) {
      Fail("a refusal that is not INVALID_ARGUMENT with a message: ", job.status().ToString());
    }
    return;
  }
  CheckTranslated(req, *job, options);
  Prepare(*job);
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
