#include "common/engine/generate.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/engine/prefill_engine.h"
#include "common/sparse/rocketkv.h"

namespace kvwire {

absl::StatusOr<PrefilledSequence> PrefillSequence(LlamaModel& model,
                                                  absl::Span<const int32_t> prompt,
                                                  const CompressionConfig& compression,
                                                  int extra_tokens,
                                                  const kernels::SamplingParams& sampling,
                                                  uint64_t seed, PrefillEngine* engine) {
  RETURN_IF_ERROR(compression.Validate());
  const int len = static_cast<int>(prompt.size());
  KvCacheShape shape =
      CompressedCacheShape(compression, model.config(), model.kv_dtype(), len, extra_tokens);
  shape.format = DecodeCacheFormat(compression.kv_format);
  PrefilledSequence seq;
  ASSIGN_OR_RETURN(seq.cache, model.NewCache(shape));
  seq.cache->set_prompt_len(len);

  std::optional<PrefillEngine> own;
  if (engine == nullptr) {
    PrefillEngineOptions options;
    options.node_name = "local";
    options.workers = 0;  // on this thread
    engine = &own.emplace(&model, options);
  }
  PrefillJob job;
  job.prompt_ids.assign(prompt.begin(), prompt.end());
  job.compression = compression;
  job.sampling = sampling;
  job.seed = seed;
  CacheStreamSink sink(StreamExpectation(model, compression, len, job.max_chunk_bytes),
                       seq.cache.get(), model.config().vocab_size);
  ASSIGN_OR_RETURN(PrefillOutcome out, engine->Run(job, sink));
  seq.logits = std::move(out.logits);
  seq.first_token = out.trailer.first_token;
  seq.first_logprob = out.trailer.first_logprob;
  seq.prefill_seconds = out.trailer.forward_ms / 1e3;
  seq.compress_seconds = out.trailer.compress_ms / 1e3;
  seq.cached_tokens = out.trailer.cached_tokens;
  return seq;
}

absl::StatusOr<GenerationResult> Generate(LlamaModel& model, const GenerationRequest& request,
                                          const std::function<void(int32_t)>& on_token) {
  const ModelConfig& c = model.config();
  const int len = static_cast<int>(request.prompt_ids.size());
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be >= 1, got ", request.max_tokens));
  }
  if (len + request.max_tokens > c.context_limit()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", len, " tokens) + max_tokens (", request.max_tokens,
                     ") exceeds the model's context of ", c.context_limit()));
  }
  CompressionConfig compression = request.compression;
  DecodeAttentionConfig attention = request.attention;
  RETURN_IF_ERROR(ResolveTwoStage(&compression, &attention, len, request.max_tokens, c.head_dim));
  const kernels::KernelBackend::CopyCounts before = model.copy_counts();
  ASSIGN_OR_RETURN(PrefilledSequence seq,
                   PrefillSequence(model, request.prompt_ids, compression, request.max_tokens,
                                   request.sampling, request.seed, request.prefill));
  const kernels::KernelBackend::CopyCounts prefilled = model.copy_counts();
  KvCache* cache = seq.cache.get();
  ASSIGN_OR_RETURN(KvAllocator * memory, model.CacheAllocator());
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeSelector> selector,
                   MakeDecodeSelector(attention, c, cache->shape(), *memory));
  GenerationResult result;
  result.prompt_tokens = len;
  result.compression = compression;
  result.attention = attention;
  result.prefill_seconds = seq.prefill_seconds;
  result.compress_seconds = seq.compress_seconds;
  result.cached_tokens = seq.cached_tokens;
  result.full_cache_bytes = int64_t{len} * c.KvBytesPerToken(model.kv_dtype());
  result.kept_cache_bytes = cache->StoredBytes();

  SamplingRng rng(request.seed);
  rng.Uniform();  // the first token's draw, taken by the prefill
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < request.max_tokens; ++i) {
    kernels::SampledToken tok{seq.first_token, seq.first_logprob};
    if (i > 0) {
      DecodeInput in;
      in.token = result.ids.back();
      in.position = len + i - 1;  // continues from the original prompt length
      in.cache = cache;
      in.selector = selector.get();
      const kernels::SampleRow row{request.sampling, rng.Uniform()};
      RETURN_IF_ERROR(model.DecodeStepSampled({&in, 1}, {&row, 1}, &tok));
    }
    result.ids.push_back(tok.id);
    result.logprobs.push_back(tok.logprob);
    if (on_token) on_token(tok.id);
    if (std::find(request.stop_ids.begin(), request.stop_ids.end(), tok.id) !=
        request.stop_ids.end()) {
      result.finish = FinishReason::kStop;
      break;
    }
  }
  result.decode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  result.prefill_copies = prefilled - before;
  result.decode_copies = model.copy_counts() - prefilled;
  return result;
}

}  // namespace kvwire
