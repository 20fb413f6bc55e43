// Single-process generation: prefill, build the sequence's KV cache, decode token by
// token. This is what `kvwire generate` runs, and the reference the service pair is
// tested against (same model, policy, budget and seed give the same tokens).
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/compression/compression.h"
#include "common/model/kv_cache.h"
#include "common/sparse/sparse_attention.h"
#include "common/model/llama_model.h"
#include "kernels/sampling.h"

namespace kvwire {

// A seeded source of the one uniform number each sampled token uses; identical on every
// platform (mt19937_64 is fully specified, and the conversion to [0, 1) is ours).
class SamplingRng {
 public:
  explicit SamplingRng(uint64_t seed) : engine_(seed) {}
  double Uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

 private:
  std::mt19937_64 engine_;
};

// A prompt prefilled into its own (compressed) KV cache, ready to decode.
struct PrefilledSequence {
  std::unique_ptr<KvCache> cache;
  std::vector<float> logits;  // of the last prompt position
  double prefill_seconds = 0;
  double compress_seconds = 0;  // part of prefill_seconds spent selecting and gathering
};

// Runs the prompt through the model, compressing each layer by `compression` into a new
// cache from `allocator` with room for `extra_tokens` generated tokens.
absl::StatusOr<PrefilledSequence> PrefillSequence(LlamaModel& model,
                                                  absl::Span<const int32_t> prompt,
                                                  const CompressionConfig& compression,
                                                  int extra_tokens,
                                                  KvAllocator& allocator = HeapKvAllocator());

enum class FinishReason { kLength, kStop };

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;
  int max_tokens = 16;
  kernels::SamplingParams sampling;
  uint64_t seed = 0;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
  CompressionConfig compression;   // how the prompt's cache is compressed (default: full)
  DecodeAttentionConfig attention; // how decode attends over it (default: dense)
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
  CompressionConfig compression;   // as applied (rocketkv resolved into its stages)
  DecodeAttentionConfig attention;
};

// Runs one request. `on_token` (optional) sees each token as soon as it is sampled.
absl::StatusOr<GenerationResult> Generate(LlamaModel& model, const GenerationRequest& request,
                                          const std::function<void(int32_t)>& on_token = {});

}  // namespace kvwire
