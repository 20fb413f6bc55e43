// Single-process generation: prefill (through the PrefillEngine, into the sequence's own
// compressed KV cache), then decode token by token. This is what `kvwire generate` and the
// eval harness run, and the reference the service pair is tested against (same model,
// policy, budget and seed give the same tokens).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/compression/compression.h"
#include "common/model/kv_cache.h"
#include "common/model/llama_model.h"
#include "common/sparse/attention.h"
#include "kernels/sampling.h"

namespace kvwire {

class PrefillEngine;

// Why generation ended: max_tokens reached, or a stop token / stop string.
enum class FinishReason { kLength, kStop };

// A prompt prefilled into its own (compressed) KV cache, ready to decode.
struct PrefilledSequence {
  std::unique_ptr<KvCache> cache;
  std::vector<float> logits;  // of the last prompt position
  int32_t first_token = 0;    // sampled from them by the request's sampling (greedy here)
  float first_logprob = 0;
  double prefill_seconds = 0;
  double compress_seconds = 0;  // part of prefill_seconds spent selecting and gathering
  int cached_tokens = 0;        // prompt tokens the engine's prefix cache held
};

// Runs the prompt through the model, compressing each layer by `compression` into a new
// cache for the model (LlamaModel::NewCache) with room for `extra_tokens` generated tokens; the
// first token is sampled with `sampling` and the first draw of `seed`. The cache keeps a coded
// kv_format's rows coded (DecodeCacheFormat).
// `engine`, when given, runs the prefill (its prefix cache, say); else a fresh one on this
// thread.
absl::StatusOr<PrefilledSequence> PrefillSequence(
    LlamaModel& model, absl::Span<const int32_t> prompt, const CompressionConfig& compression,
    int extra_tokens, const kernels::SamplingParams& sampling = {0.f}, uint64_t seed = 0,
    PrefillEngine* engine = nullptr);

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;
  int max_tokens = 16;
  kernels::SamplingParams sampling;  // greedy unless a temperature is set
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;     // generation ends after emitting one of these
  CompressionConfig compression;     // how the prompt's cache is compressed (default: full)
  DecodeAttentionConfig attention;   // how decode attends over it (default: dense)
  PrefillEngine* prefill = nullptr;  // the engine to prefill with (null: a fresh one)
};

struct GenerationResult {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  FinishReason finish = FinishReason::kLength;
  int prompt_tokens = 0;
  int64_t full_cache_bytes = 0;  // K/V of every prompt token
  int64_t kept_cache_bytes = 0;  // K/V actually kept for decode
  double prefill_seconds = 0;
  double compress_seconds = 0;
  double decode_seconds = 0;
  int cached_tokens = 0;          // the prefill engine's prefix cache hit
  CompressionConfig compression;  // as applied (rocketkv resolved into its stages)
  DecodeAttentionConfig attention;
  // The model backend's copy ledger over the prefill and over the decode steps after it.
  kernels::KernelBackend::CopyCounts prefill_copies, decode_copies;
};

// Runs one request. `on_token` (optional) sees each token as soon as it is sampled.
absl::StatusOr<GenerationResult> Generate(LlamaModel& model, const GenerationRequest& request,
                                          const std::function<void(int32_t)>& on_token = {});

}  // namespace kvwire
