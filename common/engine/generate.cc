#include "common/engine/generate.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

absl::StatusOr<PrefilledSequence> PrefillSequence(LlamaModel& model,
                                                  absl::Span<const int32_t> prompt,
                                                  const CompressionConfig& compression,
                                                  int extra_tokens, KvAllocator& allocator) {
  RETURN_IF_ERROR(compression.Validate());
  const int len = static_cast<int>(prompt.size());
  const KvCacheShape shape =
      CompressedCacheShape(compression, model.config(), model.kv_dtype(), len, extra_tokens);
  PrefilledSequence seq;
  ASSIGN_OR_RETURN(seq.cache, KvCache::Create(shape, allocator));
  seq.cache->set_prompt_len(len);
  CacheSink sink(seq.cache.get());
  Compressor compressor(compression, model.config(), model.kv_dtype(), &sink);
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(PrefillResult prefill, model.Prefill(prompt, &compressor));
  seq.prefill_seconds = Seconds(t0);
  seq.compress_seconds = compressor.seconds();
  seq.logits = std::move(prefill.logits);
  return seq;
}

absl::StatusOr<GenerationResult> Generate(LlamaModel& model, const GenerationRequest& request,
                                          const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = model.config();
  const int len = static_cast<int>(request.prompt_ids.size());
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ",
                                                   request.max_tokens));
  }
  if (len + request.max_tokens > c.context_limit()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt (", len, " tokens) + max_tokens (", request.max_tokens,
        ") exceeds the model's context of ", c.context_limit()));
  }
  CompressionConfig compression = request.compression;
  DecodeAttentionConfig attention = request.attention;
  RETURN_IF_ERROR(ResolveTwoStage(&compression, &attention, len, request.max_tokens, c.head_dim));
  ASSIGN_OR_RETURN(PrefilledSequence seq,
                   PrefillSequence(model, request.prompt_ids, compression, request.max_tokens));
  KvCache* cache = seq.cache.get();
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeSelector> selector,
                   MakeDecodeSelector(attention, c, cache->shape(), HeapKvAllocator()));
  GenerationResult result;
  result.prompt_tokens = len;
  result.compression = compression;
  result.attention = attention;
  result.prefill_seconds = seq.prefill_seconds;
  result.compress_seconds = seq.compress_seconds;
  result.full_cache_bytes = int64_t{len} * c.KvBytesPerToken(model.kv_dtype());
  result.kept_cache_bytes = cache->StoredBytes();

  SamplingRng rng(request.seed);
  std::vector<float> logits = std::move(seq.logits);
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < request.max_tokens; ++i) {
    if (i > 0) {
      DecodeInput in;
      in.token = result.ids.back();
      in.position = len + i - 1;  // continues from the original prompt length
      in.cache = cache;
      in.selector = selector.get();
      RETURN_IF_ERROR(model.DecodeStep({&in, 1}, logits.data()));
    }
    const kernels::SampledToken tok =
        kernels::Sample(logits.data(), c.vocab_size, request.sampling, rng.Uniform());
    result.ids.push_back(tok.id);
    result.logprobs.push_back(tok.logprob);
    if (on_token) on_token(tok.id);
    if (std::find(request.stop_ids.begin(), request.stop_ids.end(), tok.id) !=
        request.stop_ids.end()) {
      result.finish = FinishReason::kStop;
      break;
    }
  }
  result.decode_seconds = Seconds(t1);
  return result;
}

}  // namespace kvwire
