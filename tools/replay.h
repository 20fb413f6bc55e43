// One prefill, many compressions: what the evaluations share. A prompt's prefill is run
// once with the widest observation window any method needs, captured layer by layer, and
// replayed through each method's compressor; a method with a narrower window sees the
// last rows of the captured scores, which are exactly the scores a prefill with that window
// computes (each window query's softmax runs over its own causal row alone).
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/compression/compression.h"
#include "common/model/llama_model.h"
#include "common/sparse/attention.h"
#include "kernels/cpu_backend.h"

namespace kvwire::tools {

class CapturedPrefill : public PrefillObserver {
 public:
  CapturedPrefill(int window, const ModelConfig& model)
      : window_(window),
        n_heads_(model.num_heads),
        kv_dim_(int64_t{model.num_kv_heads} * model.head_dim),
        host_(kernels::MakeCpuBackend(1)) {}
  int window(int /*len*/) const override { return window_; }
  absl::Status OnLayer(const PrefillLayer& l) override;

  // Replays the captured prefill through `observer` (a Compressor), handing it the last
  // observer.window(len) rows of the scores; more rows than were captured is an error.
  absl::Status Replay(PrefillObserver& observer) const;

  int num_layers() const { return static_cast<int>(layers_.size()); }
  int len() const { return layers_.empty() ? 0 : layers_[0].len; }
  int captured_window() const { return layers_.empty() ? 0 : layers_[0].window; }
  // Layer `layer`'s scores [n_heads, captured_window, len] (empty when none were captured).
  const std::vector<float>& scores(int layer) const { return layers_[layer].scores; }

 private:
  struct Layer {
    int len = 0, window = 0;
    std::vector<float> k, v, scores;  // K and V packed: token t at t·kv_dim
  };
  int window_;
  int n_heads_;
  int64_t kv_dim_;
  std::vector<Layer> layers_;
  // The replayed layers' backend: the captured rows are host memory.
  kernels::KernelBackendPtr host_;
};

// A method resolved for one prompt: its compression (the window clamped to the prompt,
// rocketkv split into its two stages) and decode attention.
struct ResolvedMethod {
  CompressionConfig compression;
  DecodeAttentionConfig attention;
};
absl::StatusOr<ResolvedMethod> Resolve(CompressionConfig compression,
                                       DecodeAttentionConfig attention, int len, int max_new,
                                       const ModelConfig& model);
// The rows of window scores `compression` reads for a `len`-token prompt (0: none).
int ScoreRows(const CompressionConfig& compression, int len);

struct ReplayedCache {
  std::unique_ptr<KvCache> cache;
  // What a stream of this compression carries: positions, K and V of every kept row (the
  // wire's chunk payload, docs/wire_format.md), and the full cache's K and V.
  int64_t kv_payload_bytes = 0;
  int64_t full_cache_bytes = 0;
  int64_t full_bf16_bytes = 0;  // the same in bf16, the dtype caches are deployed in
};

// Compresses the captured prefill with `config` into a new cache with room for `extra`
// generated tokens, through the wire's chunks and receiver, keeping a coded kv_format's rows
// as a decode node would (DecodeCacheFormat).
absl::StatusOr<ReplayedCache> ReplayInto(const LlamaModel& model, const CapturedPrefill& cap,
                                         const CompressionConfig& config, int extra);

// The greedy token: the first of the largest logits.
inline int32_t Argmax(const float* logits, int n) {
  return static_cast<int32_t>(std::max_element(logits, logits + n) - logits);
}

}  // namespace kvwire::tools
