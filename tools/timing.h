// Timed greedy generation, for comparing kvwire with other engines (bench/peers): the wall
// time of the prefill and of the decode steps after it, with the ids, exactly as
// `kvwire generate` runs them (Generate, greedy; full cache and dense attention unless a
// compression and decode attention are given), and what crossed between host and backend.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/compression/compression.h"
#include "common/model/llama_model.h"
#include "common/sparse/attention.h"

namespace kvwire::tools {

struct TimedGeneration {
  // From the call to its first token: cache creation, the forward pass, the first argmax.
  double prefill_seconds = 0;
  // The `decode_steps` DecodeSteps after it, each with its argmax.
  double decode_seconds = 0;
  // The prefill's token, then one per decode step: decode_steps + 1 ids.
  std::vector<int32_t> ids;
  // The model backend's copy ledger over the prefill and over all the decode steps.
  kernels::KernelBackend::CopyCounts prefill_copies, decode_copies;
};

// Prefills `prompt` and runs `decode_steps` greedy decode steps, end-of-sequence ignored.
// A prompt that is empty, has ids outside the vocabulary, or does not leave room for the
// steps in the model's context is an InvalidArgumentError.
absl::StatusOr<TimedGeneration> TimeGreedyGeneration(LlamaModel& model,
                                                     absl::Span<const int32_t> prompt,
                                                     int decode_steps,
                                                     const CompressionConfig& compression = {},
                                                     const DecodeAttentionConfig& attention = {});

// "1,2,3" as token ids, each in [0, vocab_size); an empty list is an error.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view list, int vocab_size);

}  // namespace kvwire::tools
