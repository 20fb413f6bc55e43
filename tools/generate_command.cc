// kvwire generate: one request in this process, the text streamed as it is sampled.
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status.h"
#include "common/engine/generate.h"
#include "tools/commands.h"

namespace kvwire::tools {

void DefineSamplingFlags(Flags& flags) {
  flags.Define("max-tokens", "64", "tokens to generate");
  flags.Define("temperature", "0", "sampling temperature; 0 is greedy");
  flags.Define("top-p", "1", "nucleus sampling: smallest set of tokens with this much mass");
  flags.Define("top-k", "0", "sample among the k most likely tokens (0: all)");
  flags.Define("seed", "0", "seed of the sampler");
  flags.DefineBool("ignore-eos", "keep generating after the end-of-sequence token");
}

absl::Status SamplingFromFlags(const Flags& flags, GenerationRequest* req) {
  ASSIGN_OR_RETURN(int64_t max_tokens, flags.GetInt("max-tokens", 1, 1 << 20));
  ASSIGN_OR_RETURN(double temperature, flags.GetDouble("temperature", 0, 100));
  ASSIGN_OR_RETURN(double top_p, flags.GetDouble("top-p", 1e-6, 1));
  ASSIGN_OR_RETURN(int64_t top_k, flags.GetInt("top-k", 0, 1 << 30));
  ASSIGN_OR_RETURN(int64_t seed, flags.GetInt("seed", 0, INT64_MAX));
  req->max_tokens = static_cast<int>(max_tokens);
  req->sampling.temperature = static_cast<float>(temperature);
  req->sampling.top_p = static_cast<float>(top_p);
  req->sampling.top_k = static_cast<int>(top_k);
  req->seed = static_cast<uint64_t>(seed);
  return absl::OkStatus();
}

absl::Status CompressionAndAttentionFromFlags(const Flags& flags,
                                              const std::set<std::string>& shared,
                                              CompressionConfig* compression,
                                              DecodeAttentionConfig* attention) {
  ASSIGN_OR_RETURN(*compression, CompressionFromFlags(flags, shared));
  for (const char* flag :
       {"attention", "attention-budget", "attention-k", "attention-r", "attention-page"}) {
    if (!compression->policy->selects() && flags.IsSet(flag)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " does not apply to --policy ", compression->policy_name(),
                       ", which sets its own decode attention (hybrid, from --budget)"));
    }
  }
  ASSIGN_OR_RETURN(*attention, AttentionFromFlags(flags));
  return absl::OkStatus();
}

int RunGenerate(int argc, char** argv) {
  Flags flags;
  DefineModelFlags(flags);
  DefineSamplingFlags(flags);
  DefineCompressionFlags(flags);
  DefineKvFormatFlag(flags);
  DefineAttentionFlags(flags);
  flags.Define("prompt", "", "the prompt text (BOS is added as the tokenizer specifies)");
  const char* usage =
      "kvwire generate --model DIR --prompt TEXT [--max-tokens N] [--temperature T] "
      "[--top-p P] [--top-k K] [--seed S] [--policy NAME --budget N ...]";
  if (int rc = ParseFlagsOrExit(flags, "kvwire generate", usage, argc, argv, 0); rc >= 0) return rc;

  GenerationRequest req;
  if (absl::Status st = SamplingFromFlags(flags, &req); !st.ok()) return Fail("generate", st);
  // --seed is the sampler's; the random policy takes it too.
  if (absl::Status st =
          CompressionAndAttentionFromFlags(flags, {"seed"}, &req.compression, &req.attention);
      !st.ok()) {
    return Fail("generate", st);
  }
  auto model_or = LoadModelFromFlags(flags);
  if (!model_or.ok()) return Fail("generate", model_or.status());
  LlamaModel& model = **model_or;
  const Tokenizer& tok = model.tokenizer();
  auto ids = tok.Encode(flags.GetString("prompt"));
  if (!ids.ok()) return Fail("generate", ids.status());
  req.prompt_ids = *ids;
  if (!flags.GetBool("ignore-eos")) {
    req.stop_ids = model.config().eos_token_ids;
    if (req.stop_ids.empty() && tok.eos_id()) req.stop_ids.push_back(*tok.eos_id());
  }

  std::fprintf(stderr, "model: %s\n", model.description().c_str());
  std::printf("%s", flags.GetString("prompt").c_str());
  std::fflush(stdout);
  StreamingDecoder decoder(tok);
  if (absl::Status st = decoder.Prime(req.prompt_ids); !st.ok()) return Fail("generate", st);
  absl::Status stream_status;
  auto result = Generate(model, req, [&](int32_t id) {
    auto delta = decoder.Push(id);
    if (!delta.ok()) {
      stream_status = delta.status();
      return;
    }
    std::fwrite(delta->data(), 1, delta->size(), stdout);
    std::fflush(stdout);
  });
  const std::string tail = decoder.Flush();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::printf("\n");
  if (!result.ok()) return Fail("generate", result.status());
  if (!stream_status.ok()) return Fail("generate", stream_status);
  const GenerationResult& r = *result;
  const int n = static_cast<int>(r.ids.size());
  std::fprintf(stderr,
               "prompt %d tokens, generated %d (%s); prefill %.1f ms (%.0f tok/s), decode %.0f "
               "tok/s\n",
               r.prompt_tokens, n, r.finish == FinishReason::kStop ? "stop" : "length",
               r.prefill_seconds * 1e3, r.prompt_tokens / std::max(r.prefill_seconds, 1e-9),
               n > 1 ? (n - 1) / std::max(r.decode_seconds, 1e-9) : 0.0);
  const int kept = r.compression.KeptTokens(r.compression.skip_layers, r.prompt_tokens);
  std::fprintf(stderr,
               "compression: %s, decode attention %s; kept %d of %d prompt tokens per head "
               "(%.1f%%), %.2f ms\n"
               "kv cache: full %lld bytes, compressed %lld bytes (%.1fx smaller)\n",
               r.compression.Describe().c_str(), r.attention.Describe().c_str(), kept,
               r.prompt_tokens, 100.0 * kept / std::max(r.prompt_tokens, 1),
               r.compress_seconds * 1e3, static_cast<long long>(r.full_cache_bytes),
               static_cast<long long>(r.kept_cache_bytes),
               static_cast<double>(r.full_cache_bytes) / std::max<int64_t>(r.kept_cache_bytes, 1));
  return 0;
}

}  // namespace kvwire::tools
