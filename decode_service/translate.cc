#include "decode_service/translate.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

constexpr int kMaxStopStrings = 16;
constexpr int kMaxStopTokenIds = 64;
constexpr size_t kMaxStopBytes = 256;
constexpr size_t kMaxRequestIdBytes = 256;

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return AboutField(absl::InvalidArgumentError(absl::StrCat(field, ": ", what)), field);
}

}  // namespace

absl::StatusOr<GenerationJob> TranslateGenerateRequest(const v1::GenerateRequest& req,
                                                       const LlamaModel& model,
                                                       const DecodeServerOptions& options,
                                                       uint64_t sequence) {
  const ModelConfig& mc = model.config();
  GenerationJob j;
  if (req.request_id().size() > kMaxRequestIdBytes) {
    return Bad("request_id", absl::StrCat("longer than ", kMaxRequestIdBytes, " bytes"));
  }
  j.request_id = req.request_id().empty() ? absl::StrCat(options.engine.node_name, "-", sequence)
                                          : req.request_id();
  const int max_prompt =
      options.max_prompt_tokens > 0 ? options.max_prompt_tokens : mc.context_limit();
  switch (req.input_case()) {
    case v1::GenerateRequest::kPrompt:
      if (req.prompt().empty()) return Bad("prompt", "is empty");
      // A generous bound in bytes (tokens are at least one byte) keeps tokenizing cheap.
      if (req.prompt().size() > static_cast<size_t>(max_prompt) * 32) {
        return Bad("prompt", absl::StrCat(req.prompt().size(), " bytes is far beyond the ",
                                          max_prompt, "-token prompt limit"));
      }
      j.prompt_text = req.prompt();
      break;
    case v1::GenerateRequest::kPromptIds: {
      if (req.prompt_ids().ids_size() == 0) return Bad("prompt_ids", "is empty");
      if (req.prompt_ids().ids_size() > max_prompt) {
        return Bad("prompt_ids", absl::StrCat(req.prompt_ids().ids_size(),
                                              " tokens exceeds the limit of ", max_prompt));
      }
      for (int i = 0; i < req.prompt_ids().ids_size(); ++i) {
        const int32_t id = req.prompt_ids().ids(i);
        if (id < 0 || id >= mc.vocab_size) {
          return Bad("prompt_ids",
                     absl::StrCat("ids[", i, "] = ", id, " is outside the vocabulary [0, ",
                                  mc.vocab_size, ")"));
        }
        j.prompt_ids.push_back(id);
      }
      break;
    }
    default:
      return Bad("input", "set either prompt (text) or prompt_ids");
  }

  const v1::SamplingParams& sp = req.sampling();
  j.max_tokens = sp.has_max_tokens() ? sp.max_tokens() : options.default_max_tokens;
  if (j.max_tokens < 1 || j.max_tokens > options.max_tokens_limit) {
    return Bad("sampling.max_tokens",
               absl::StrCat("must be in [1, ", options.max_tokens_limit, "], got ", j.max_tokens));
  }
  j.sampling.temperature = sp.has_temperature() ? sp.temperature() : 0.f;
  if (!std::isfinite(j.sampling.temperature) || j.sampling.temperature < 0 ||
      j.sampling.temperature > 100) {
    return Bad("sampling.temperature",
               absl::StrCat("must be in [0, 100], got ", j.sampling.temperature));
  }
  j.sampling.top_p = sp.has_top_p() ? sp.top_p() : 1.f;
  if (!(j.sampling.top_p > 0 && j.sampling.top_p <= 1)) {
    return Bad("sampling.top_p", absl::StrCat("must be in (0, 1], got ", j.sampling.top_p));
  }
  j.sampling.top_k = sp.has_top_k() ? sp.top_k() : 0;
  if (j.sampling.top_k < 0) {
    return Bad("sampling.top_k",
               absl::StrCat("must be >= 0 (0: no limit), got ", j.sampling.top_k));
  }
  j.seed = sp.has_seed() ? sp.seed() : 0;
  if (sp.stop_size() > kMaxStopStrings) {
    return Bad("sampling.stop",
               absl::StrCat("at most ", kMaxStopStrings, " strings, got ", sp.stop_size()));
  }
  for (const std::string& s : sp.stop()) {
    if (s.empty() || s.size() > kMaxStopBytes) {
      return Bad("sampling.stop",
                 absl::StrCat("each stop string must be 1..", kMaxStopBytes, " bytes"));
    }
    j.stop.push_back(s);
  }
  if (sp.stop_token_ids_size() > kMaxStopTokenIds) {
    return Bad("sampling.stop_token_ids",
               absl::StrCat("at most ", kMaxStopTokenIds, " ids, got ", sp.stop_token_ids_size()));
  }
  for (int32_t id : sp.stop_token_ids()) {
    if (id < 0 || id >= mc.vocab_size) {
      return Bad("sampling.stop_token_ids",
                 absl::StrCat(id, " is outside the vocabulary [0, ", mc.vocab_size, ")"));
    }
    j.stop_ids.push_back(id);
  }
  if (!sp.ignore_eos()) {
    for (int32_t e : mc.eos_token_ids) j.stop_ids.push_back(e);
    if (mc.eos_token_ids.empty() && model.tokenizer().eos_id()) {
      j.stop_ids.push_back(*model.tokenizer().eos_id());
    }
  }

  j.compression = options.default_compression;
  RETURN_IF_ERROR(ApplyCompressionParams(req.compression(), &j.compression));
  RETURN_IF_ERROR(
      RenameParams(j.compression.ValidateFor(mc.num_layers, mc.head_dim),
                   [](absl::string_view n) { return absl::StrCat("compression.", n); }));
  const v1::DecodeAttentionParams& ap = req.attention();
  const bool attention_set = !ap.mode().empty() || ap.has_token_budget() || ap.has_top_k() ||
                             ap.has_top_r() || ap.has_page_size();
  if (!j.compression.policy->selects()) {
    // rocketkv derives its stage-2 attention from its own budget: nothing to set.
    if (attention_set) {
      return Bad("attention", absl::StrCat(j.compression.policy_name(),
                                           " sets its own decode attention (hybrid, from "
                                           "compression.budget); leave attention unset"));
    }
    j.logprobs = req.return_logprobs();
    return j;
  }
  j.attention = options.default_attention;
  if (!ap.mode().empty()) {
    auto mode = ParseAttentionMode(ap.mode());
    if (!mode.ok()) return Bad("attention.mode", mode.status().message());
    if (*mode != j.attention.mode) {
      // Another mode starts from its own defaults; a token budget is every sparse mode's.
      DecodeAttentionConfig other{*mode};
      if (*mode != AttentionMode::kDense) other.token_budget = j.attention.token_budget;
      j.attention = other;
    }
  }
  if (ap.has_token_budget()) j.attention.token_budget = ap.token_budget();
  if (ap.has_top_k()) j.attention.top_k = ap.top_k();
  if (ap.has_top_r()) j.attention.top_r = ap.top_r();
  if (ap.has_page_size()) j.attention.page_size = ap.page_size();
  RETURN_IF_ERROR(j.attention.Validate());  // "attention: top_r does not apply to quest ..."
  if (j.attention.top_r > mc.head_dim) {
    return Bad("attention.top_r", absl::StrCat("must be at most the head dimension (", mc.head_dim,
                                               "), got ", j.attention.top_r));
  }
  j.logprobs = req.return_logprobs();
  return j;
}

v1::PrefillRequest ToPrefillRequest(const PrefillJob& job) {
  v1::PrefillRequest req;
  req.set_request_id(job.request_id);
  for (int32_t id : job.prompt_ids) req.add_prompt_ids(id);
  *req.mutable_compression() = ToProto(job.compression);
  req.set_model_fingerprint(job.model_fingerprint.value_or(""));
  req.set_max_chunk_bytes(static_cast<uint32_t>(job.max_chunk_bytes));
  req.set_temperature(job.sampling.temperature);
  req.set_top_p(job.sampling.top_p);
  req.set_top_k(job.sampling.top_k);
  req.set_seed(job.seed);
  if (job.transport == KvTransport::kShm) {
    req.set_kv_transport(v1::KV_TRANSPORT_SHM);
    *req.mutable_region() = ToProto(job.region_name, job.region_bytes, job.region_shape);
  } else if (job.transport == KvTransport::kCudaIpc) {
    req.set_kv_transport(v1::KV_TRANSPORT_CUDA_IPC);
    *req.mutable_region() = ToProto(job.transport, job.region_handle, job.region_bytes,
                                    job.region_shape, job.region_place);
  } else if (job.transport == KvTransport::kNccl) {
    req.set_kv_transport(v1::KV_TRANSPORT_NCCL);
    *req.mutable_region() =
        ToProto(job.transport, job.link_peer, job.region_bytes, job.region_shape, job.region_place);
  }
  return req;
}

}  // namespace kvwire
