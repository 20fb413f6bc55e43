// Prompt KV compression: after each prefill layer, choose the prompt positions decode will
// need and keep only their K/V. The policies are named as in their papers (see
// docs/algorithms.md for the specification each implements, with citations):
//
//   full       no eviction
//   streaming  attention sinks + the most recent tokens (StreamingLLM)
//   random     uniform random prefix positions + the window (seeded)
//   snapkv     SnapKV, Listing 1: observation-window votes, 1-D pooling, top-k per head
//   snapkv_pp  SnapKV++, RocketKV Algorithm 1: group-summed votes, adaptive kernel
//   chunkkv    ChunkKV, Algorithms 1-2: whole chunks, one index set per layer, layer reuse
//   hbw        HBW-KV: block-wise and hierarchical (grouped) selection
//   rocketkv   RocketKV's two stages from one per-step token budget: SnapKV++ here plus
//              hybrid sparse attention at decode (common/sparse_attention.h resolves it
//              into the two before a prefill runs)
//
// Budget semantics (every policy): `budget` tokens are kept per cache head, the
// observation window included; a prompt not longer than the budget is kept whole. Kept
// positions are sorted ascending.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model/kv_cache.h"
#include "common/model/llama_model.h"
#include "common/model/model_config.h"

namespace kvwire {

enum class Policy { kFull, kStreaming, kRandom, kSnapKV, kSnapKVpp, kChunkKV, kHBW, kRocketKV };
enum class PoolKind { kMax, kAvg };
// How SnapKV turns the query heads' votes into selections under GQA.
enum class GqaMode {
  kPerQueryHead,  // the original SnapKV code: each query head selects; n_rep times the cache
  kSum,           // one selection per KV head from the group's summed votes (default)
  kMean,
  kMax,
};

absl::string_view PolicyName(Policy p);
absl::StatusOr<Policy> ParsePolicy(absl::string_view name);
absl::string_view PoolName(PoolKind p);
absl::StatusOr<PoolKind> ParsePool(absl::string_view name);
absl::string_view GqaName(GqaMode g);
absl::StatusOr<GqaMode> ParseGqa(absl::string_view name);
// "full, streaming, random, snapkv, snapkv_pp, chunkkv, hbw, rocketkv"
std::string PolicyNames();

// The largest observation window accepted.
inline constexpr int kMaxWindow = 1024;

struct CompressionConfig {
  Policy policy = Policy::kFull;
  int budget = 0;      // tokens kept per cache head, window included (0: from ratio)
  double ratio = 0;    // alternative: kept / prompt tokens, in (0, 1]
  int window = 16;     // observation window w (SnapKV §4.1)
  PoolKind pool = PoolKind::kMax;
  int kernel = 7;      // pooling kernel (odd; 1 = no pooling)
  GqaMode gqa = GqaMode::kSum;
  // snapkv_pp: kernel by prompt length (RocketKV App. A.3: 63 below 48K tokens, else 511).
  int kernel_small = 63;
  int kernel_large = 511;
  int kernel_threshold = 48 * 1024;
  // chunkkv
  int chunk = 10;         // tokens per chunk (ChunkKV §4)
  int reuse_layers = 1;   // N_reuse: layers per group sharing the first one's indices
  // hbw
  int block = 0;                  // block size T; 0 means budget / 32 (HBW §4.4.1)
  std::vector<int> groups = {1, 8};  // hierarchical rounds: group counts M
  // streaming
  int sinks = 4;
  // random
  uint64_t seed = 0;
  // The first `skip_layers` layers keep every prompt token (dense).
  int skip_layers = 0;

  // Parameters that make no sense are InvalidArgument naming the parameter and why.
  absl::Status Validate() const;
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

// SnapKV-family scoring of one layer: the observation-window attention probabilities
// [n_heads, window, len] (PrefillAttentionParams::window_scores).
struct WindowScores {
  const float* data = nullptr;
  int n_heads = 0;
  int window = 0;
  int len = 0;
};

// Chooses kept positions layer by layer; holds ChunkKV's reused index sets.
class LayerSelector {
 public:
  LayerSelector(const CompressionConfig& config, int n_heads, int n_kv_heads);
  // One ascending list of kept prompt positions per cache head. `scores` may be null
  // when the layer does not need them (see NeedsScoresFor).
  absl::StatusOr<std::vector<std::vector<int32_t>>> Select(int layer, int len,
                                                           const WindowScores* scores);
  bool NeedsScoresFor(int layer, int len) const;

 private:
  CompressionConfig config_;
  int n_heads_, n_kv_heads_;
  std::vector<std::vector<int32_t>> reuse_;  // ChunkKV: the group anchor's selection
};

// One layer of a compressed cache, as it goes on the wire or into a KvCache.
struct CompressedLayer {
  int layer = 0;
  int n_heads = 0;  // cache heads
  int head_dim = 0;
  int count = 0;    // tokens per head
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
// gathered K/V in the cache dtype → sink, one layer at a time.
class Compressor : public PrefillObserver {
 public:
  Compressor(const CompressionConfig& config, const ModelConfig& model, DType kv_dtype,
             CompressedLayerSink* sink);
  int window(int len) const override;
  absl::Status OnLayer(const PrefillLayer& layer) override;
  // Seconds spent selecting and gathering (the compression overhead).
  double seconds() const { return seconds_; }

 private:
  CompressionConfig config_;
  int n_heads_, n_kv_heads_, head_dim_;
  DType kv_dtype_;
  LayerSelector selector_;
  CompressedLayerSink* sink_;
  double seconds_ = 0;
};

// Shape of the cache a compressed prompt of `len` tokens needs, with room for
// `extra_tokens` generated ones.
KvCacheShape CompressedCacheShape(const CompressionConfig& config, const ModelConfig& model,
                                  DType kv_dtype, int len, int extra_tokens);

// Writes a compressed layer into a cache (checks it fits and matches).
absl::Status StoreLayer(const CompressedLayer& layer, KvCache* cache);

// Stores every layer it is given into one cache.
class CacheSink : public CompressedLayerSink {
 public:
  explicit CacheSink(KvCache* cache) : cache_(cache) {}
  absl::Status Accept(CompressedLayer layer) override { return StoreLayer(layer, cache_); }

 private:
  KvCache* cache_;
};

}  // namespace kvwire
