// Prompt KV compression: after each prefill layer, choose the prompt positions decode will
// need and keep only their K/V. A CompressionConfig is a policy (policy.h: one file per
// paper, listed by the registry) plus what every policy shares:
//
//   budget       tokens kept per cache head, the observation window included (or `ratio`:
//                kept / prompt tokens); a prompt not longer than the budget is kept whole
//   window       the observation window: the last `window` prompt tokens score the prefix
//                and are always kept
//   skip_layers  the first layers keep every prompt token (dense)
//
// Kept positions are sorted ascending. docs/algorithms.md specifies each policy, with
// citations.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/kv_format.h"
#include "common/compression/policy.h"
#include "common/model/kv_cache.h"
#include "common/model/llama_model.h"
#include "common/model/model_config.h"

namespace kvwire {

// The largest observation window accepted.
inline constexpr int kMaxWindow = 1024;

struct CompressionConfig {
  PolicyPtr policy = FullPolicy();  // never null
  int budget = 0;                   // tokens kept per cache head, window included (0: from ratio)
  double ratio = 0;                 // alternative: kept / prompt tokens, in (0, 1]
  int window = 16;                  // observation window w (SnapKV §4.1)
  int skip_layers = 0;
  // How kept K/V rows are coded on the wire, for every policy (full included).
  KvFormat kv_format = KvFormat::kAuto;

  absl::string_view policy_name() const { return policy->name(); }
  // Parameters that make no sense are InvalidArgument naming the parameter and why.
  absl::Status Validate() const;
  // What needs the model: skip_layers below its layer count, a KV format its heads can take.
  absl::Status ValidateFor(int num_layers, int head_dim) const;
  // The budget for a prompt of `len` tokens (from `ratio` when budget is 0).
  int EffectiveBudget(int len) const;
  // Whether a prompt of `len` tokens is compressed at all.
  bool Compresses(int len) const;
  // Tokens per cache head that `layer` keeps of a `len`-token prompt.
  int KeptTokens(int layer, int len) const;
  // Cache heads: the query heads for SnapKV per query head, else the KV heads.
  int CacheHeads(int n_heads, int n_kv_heads) const;
  bool NeedsScores() const;
  std::string Describe() const;
};

// The shared parameters by name, as ApplyCompressionValues takes them besides the policy's.
inline constexpr const char* kSharedCompressionParams[] = {"budget", "ratio", "window",
                                                           "skip_layers"};

// Applies named values to `config`: "policy" switches the policy (whose parameters then start
// at their defaults, and whose budget does not carry over); "budget", "ratio", "window" and
// "skip_layers" set the shared parameters; any other name is a parameter of the resulting
// policy, and one it does not take is InvalidArgument naming it. Messages start with the
// parameter's name, for the caller to prefix ("compression.", "--"). Validates the result.
absl::Status ApplyCompressionValues(const ParamValues& values, CompressionConfig* config);
// The inverse: every value ApplyCompressionValues needs to rebuild `config` from scratch.
ParamValues CompressionValues(const CompressionConfig& config);

// Chooses the kept positions of one prompt, layer by layer: the policy's choice among the
// prefix plus the window, or everything for a dense layer or a short prompt. The choice is
// computed with a backend's selection ops in its memory (SelectOn), where the prefill left the
// layer's window scores; Select does the same on the host, with a CPU backend of its own.
class LayerSelector {
 public:
  LayerSelector(const CompressionConfig& config, int n_heads, int n_kv_heads);
  ~LayerSelector();
  LayerSelector(const LayerSelector&) = delete;
  LayerSelector& operator=(const LayerSelector&) = delete;

  // One ascending list of kept prompt positions per cache head. `scores` (host memory) may be
  // null when the layer does not need them (see NeedsScoresFor).
  absl::StatusOr<KeptRows> Select(int layer, int len, const WindowScores* scores);
  // The same in `backend`'s memory, where `scores` are: [cache heads, *count] positions, each
  // row ascending, valid until the next call.
  absl::StatusOr<const int32_t*> SelectOn(kernels::KernelBackend& backend, int layer, int len,
                                          const WindowScores* scores, int* count);
  bool NeedsScoresFor(int layer, int len) const;
  int cache_heads() const { return config_.CacheHeads(n_heads_, n_kv_heads_); }

 private:
  // Buffers in `backend`'s memory for a prompt of `len` tokens (kept while it stays the same).
  absl::Status Reserve(kernels::KernelBackend& backend, int len);
  void Release();

  CompressionConfig config_;
  int n_heads_, n_kv_heads_;
  PromptState state_;
  kernels::KernelBackendPtr host_;             // Select's, made at its first call
  kernels::KernelBackend* backend_ = nullptr;  // whose memory the buffers are
  int reserved_len_ = -1;
  SelectionOps ops_;
  int32_t* all_ = nullptr;  // [cache heads, len]: every position, for a layer kept whole
};

// One layer of a compressed cache, as it goes on the wire or into a KvCache.
struct CompressedLayer {
  int layer = 0;
  int n_heads = 0;  // cache heads
  int head_dim = 0;
  int count = 0;  // tokens per head
  DType dtype = DType::kF32;
  std::vector<int32_t> positions;  // [n_heads, count], ascending per head
  std::vector<uint8_t> k, v;       // [n_heads, count, head_dim] in dtype
};

class CompressedLayerSink {
 public:
  virtual ~CompressedLayerSink() = default;
  virtual absl::Status Accept(CompressedLayer layer) = 0;
};

// The prefill observer that compresses: window scores → policy → kept positions →
// gathered K/V in the cache dtype → sink, one layer at a time. Everything up to the gathered
// rows runs on the prefill's backend (PrefillLayer::backend), so a GPU ships only the kept
// rows and their positions to the host.
class Compressor : public PrefillObserver {
 public:
  Compressor(const CompressionConfig& config, const ModelConfig& model, DType kv_dtype,
             CompressedLayerSink* sink);
  ~Compressor() override;
  int window(int len) const override;
  bool NeedsScores(int layer, int len) const override;
  absl::Status OnLayer(const PrefillLayer& layer) override;
  // Hands the sink the last layer, whose rows may still have been on their way.
  absl::Status Finish() override;
  // Seconds spent selecting and gathering (the compression overhead).
  double seconds() const { return seconds_; }

 private:
  void ReleaseSendBuffers();
  // Waits for the pending layer's copies and hands it to the sink.
  absl::Status Deliver();

  CompressionConfig config_;
  int n_heads_, n_kv_heads_, head_dim_;
  DType kv_dtype_;
  LayerSelector selector_;
  CompressedLayerSink* sink_;
  double seconds_ = 0;
  // The gathered rows, in the backend's memory.
  kernels::KernelBackend* backend_ = nullptr;
  void* k_out_ = nullptr;
  void* v_out_ = nullptr;
  size_t out_bytes_ = 0;
  // On a device, a layer's kept rows are copied to the host while the next layer computes:
  // the layer on its way, and its copies.
  CompressedLayer pending_;
  std::vector<kernels::KernelBackend::CopyTicket> tickets_;
  bool has_pending_ = false;
};

// Writes a compressed layer into a cache (checks it fits and matches).
absl::Status StoreLayer(const CompressedLayer& layer, KvCache* cache);

// Shape of the cache a compressed prompt of `len` tokens needs, with room for
// `extra_tokens` generated ones.
KvCacheShape CompressedCacheShape(const CompressionConfig& config, const ModelConfig& model,
                                  DType kv_dtype, int len, int extra_tokens);

// How a decode cache keeps the rows of a stream coded in `wire` (KvCacheShape::format): a coded
// format (fp8, int8, int4) as the wire's codes, dequantised by decode attention (dense and
// sparse) as it reads them, on every backend; bf16 and auto in the cache dtype, converted on
// arrival (docs/algorithms.md §10.7).
KvFormat DecodeCacheFormat(KvFormat wire);

}  // namespace kvwire
