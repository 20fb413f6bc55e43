// Token sampling from logits: greedy, temperature, top-k, top-p (nucleus), seeded.
//
// Both implementations draw from the same distribution with the same single uniform
// number per step, so a seeded request gives the same tokens on either: candidates are
// ordered by (probability desc, token id asc), truncated by top-k and then top-p, and
// the token is the first whose cumulative probability exceeds u · total.
#pragma once

#include <cstdint>
#include <random>

namespace kvwire::kernels {

struct SamplingParams {
  // 0, the default: greedy (argmax, lowest id on ties), as the CLI and the gRPC API (an unset
  // proto3 field) are; a caller who wants sampling says so.
  float temperature = 0.f;
  int top_k = 0;      // 0: no limit
  float top_p = 1.f;  // 1: no limit
};

struct SampledToken {
  int32_t id = 0;
  float logprob = 0.f;  // log-probability under the model (temperature 1, no truncation)
};

// `uniform` in [0, 1) comes from the caller's seeded generator; unused when greedy.
// The reference sorts the whole vocabulary; the fast one selects partially.
SampledToken SampleReference(const float* logits, int vocab, const SamplingParams& params,
                             double uniform);
SampledToken Sample(const float* logits, int vocab, const SamplingParams& params, double uniform);

}  // namespace kvwire::kernels

namespace kvwire {

// A seeded source of the one uniform number each sampled token uses; identical on every
// platform (mt19937_64 is fully specified, and the conversion to [0, 1) is ours). The first
// token of a request takes the first draw wherever it is sampled (the prefill node), and
// the decode node's generator skips that draw to stay in step.
class SamplingRng {
 public:
  explicit SamplingRng(uint64_t seed) : engine_(seed) {}
  double Uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

 private:
  std::mt19937_64 engine_;
};

}  // namespace kvwire
