// A Llama-family transformer (Llama 2/3, Mistral, Qwen2) on a KernelBackend, shaped for
// disaggregated serving:
//
//   Prefill(prompt)      full causal attention over the prompt, layer by layer; after each
//                        layer's attention an observer sees that layer's K/V (after RoPE)
//                        and, if it asks, the observation-window attention scores, so the
//                        compressor can pick the kept positions and ship the layer while the
//                        next one computes. Returns the last position's logits.
//   DecodeStep(batch)    one token for each of a batch of sequences, each with its own
//                        (compressed) cache and RoPE position, appending to the caches.
//
// Weights come from a Hugging Face folder (config.json, *.safetensors, tokenizer.json),
// memory-mapped and used in place when no dtype conversion is asked, or from a synthetic
// spec ("synthetic:llama-1b") with deterministic random weights.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/decode_selector.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "common/model/model_config.h"
#include "common/tokenizer/tokenizer.h"
#include "kernels/backend.h"

namespace kvwire {

class WeightFiles;

struct LoadOptions {
  // Convert weights to this dtype at load ("BF16 converted at load"); default: as stored.
  std::optional<DType> weight_dtype;
  kernels::BackendKind backend = kernels::BackendKind::kCpu;
  int threads = 0;  // CPU threads, 0 for all cores
  // Host backends only: the kernels read the weights where loading left them (a model file's
  // mapping, shared with other processes through the page cache) instead of a copy on huge
  // pages. Loads faster and shares memory; decode reads the weights slower
  // (docs/benchmarks.md, "Weights on huge pages"). A device backend refuses it.
  bool mapped_weights = false;
  // A device backend's memory cap in bytes (0: the device's own): emulates a smaller device,
  // and makes its out-of-memory paths testable. A host backend refuses one.
  size_t device_memory_bytes = 0;
  // A device model's own KV pool (NewCache), made at its first use: its bytes and page bytes.
  // A decode node brings a pool of its own (KvPool::OnBackend) instead.
  size_t kv_pool_bytes = size_t{1} << 30;
  size_t kv_page_bytes = size_t{64} << 10;
  // A device backend that records graphs (KernelBackend::SupportsGraphs: cuda; guarded, which
  // emulates them) runs each decode step as one graph, its launches costing one (vLLM's
  // and SGLang's CUDA graphs, llama.cpp's per-step update). False: op by op (vLLM's
  // --enforce-eager).
  bool decode_graphs = true;
};

// What a prefill observer sees after one layer's attention, in the memory of `backend` (device
// memory on a GPU: an observer reads it with the backend's ops, or copies it).
struct PrefillLayer {
  int layer = 0;
  int len = 0;  // prompt tokens
  kernels::KernelBackend* backend = nullptr;
  // K (after RoPE) and V: token t, KV head g at k + t·kv_stride + g·head_dim.
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t kv_stride = 0;
  // Observation-window scores [n_heads, window, len] (see PrefillAttentionParams), or null.
  const float* window_scores = nullptr;
  int window = 0;
};

class PrefillObserver {
 public:
  virtual ~PrefillObserver() = default;
  // Rows of window scores wanted for a `len`-token prompt (0: none); clamped to len.
  virtual int window(int len) const = 0;
  // Whether `layer` needs them (a layer that reuses another's selection does not: ChunkKV's
  // index reuse saves computing them).
  virtual bool NeedsScores(int layer, int len) const { return true; }
  // Called after each layer, in order. An error stops the prefill and is returned by it
  // (that is how cancellation and deadlines reach into a long prompt).
  virtual absl::Status OnLayer(const PrefillLayer& layer) = 0;
  // Called once after the last layer (before the logits): an observer that let a layer's work
  // run on while the next layer computed finishes it here.
  virtual absl::Status Finish() { return absl::OkStatus(); }
};

struct PrefillResult {
  std::vector<float> logits;  // [vocab], or [len, vocab] with all_logits
};

// A prompt's first tokens as an earlier prefill computed them (the prefill tier's prefix
// cache): per block of block_tokens tokens and per layer, the rows' K (after RoPE) and V, each
// row K then V ([block_tokens, 2 · kv_heads · head_dim] floats, in the backend's memory).
struct PrefillPrefix {
  int block_tokens = 0;
  std::vector<std::vector<const float*>> blocks;  // [block][layer]
  int tokens() const { return block_tokens * static_cast<int>(blocks.size()); }
};

// Receives decode-time attention probabilities, for fidelity measurements.
class DecodeObserver {
 public:
  virtual ~DecodeObserver() = default;
  // probs: [n_heads, len] over the sequence's cache tokens (prompt part first).
  virtual void OnAttention(int seq, int layer, const float* probs, int len) = 0;
};

// Wall time of one decode step's attention, summed over the layers (for benchmarks): the
// sparse selection (plans, page summaries, scores, top-k) and the attention kernel.
struct DecodeTimes {
  double selection_s = 0;
  double attention_s = 0;
};

struct DecodeInput {
  int32_t token = 0;
  int32_t position = 0;  // RoPE position: original prompt length + tokens generated before
  KvCache* cache = nullptr;
  DecodeSelector* selector = nullptr;  // null: dense attention
};

class LlamaModel {
 public:
  // `spec` is a Hugging Face model folder or "synthetic:NAME[,key=value...]"
  // (see SyntheticSpecHelp()).
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& spec,
                                                          const LoadOptions& options = {});
  ~LlamaModel();

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // "stories260K-hf (f32 weights, model.safetensors)" or "synthetic:llama-1b (bf16 ...)".
  const std::string& description() const { return description_; }
  DType weight_dtype() const { return weight_dtype_; }
  // Identifies the model a KV cache belongs to: prefill and decode nodes must agree on it.
  // A hash of the architecture, the shapes, the KV dtype and a sample of the weights.
  const std::string& fingerprint() const { return fingerprint_; }
  // Bytes of weights one decode step reads.
  int64_t WeightBytes() const;
  // The backend's copy ledger (KernelBackend::copy_counts): what crossed between the host and
  // the backend's memory so far.
  kernels::KernelBackend::CopyCounts copy_counts() const { return backend_->copy_counts(); }
  // The dtype caches hold: the model's compute dtype class (bf16/f16 weights → that, else f32).
  DType kv_dtype() const { return weight_dtype_; }

  // Runs the prompt through the model. `ids` must be non-empty and within the context.
  // With `prefix`, the K and V of its tokens (the first of `ids`) are taken as they are and only
  // the rest is computed: their rows' queries, MLPs and logits are skipped, while attention and
  // the observer still see every key. The observer's window must lie in the computed rows, and
  // all_logits is refused.
  absl::StatusOr<PrefillResult> Prefill(absl::Span<const int32_t> ids, PrefillObserver* observer,
                                        bool all_logits = false,
                                        const PrefillPrefix* prefix = nullptr);

  // Appends each input's token to its cache and writes logits [batch, vocab]. Each cache
  // needs room for one more token per layer. Not reentrant; Prefill may run concurrently.
  // `times`, when given, receives where the step's time went.
  absl::Status DecodeStep(absl::Span<const DecodeInput> batch, float* logits,
                          DecodeObserver* observer = nullptr, DecodeTimes* times = nullptr);
  // DecodeStep that samples each sequence's token on the backend (kernels::Sample), with
  // rows[b] its sampling and the uniform its generator drew, into out[b]: the ids and their
  // log-probabilities are all that comes back to the host, not the logits.
  absl::Status DecodeStepSampled(absl::Span<const DecodeInput> batch,
                                 absl::Span<const kernels::SampleRow> rows,
                                 kernels::SampledToken* out, DecodeTimes* times = nullptr);

  // Makes `cache` ready for DecodeStep: on a device backend its device copy is allocated and
  // given the rows the host holds (a full device is RESOURCE_EXHAUSTED for this cache alone,
  // where inside DecodeStep it would fail the whole batch); nothing on a host backend.
  // DecodeStep does it itself for a cache that was not prepared.
  absl::Status PrepareForDecode(KvCache& cache);

  static std::string SyntheticSpecHelp();

  // One layer's causal prefill attention as Prefill runs it, over `len` rows of a q|k|v buffer
  // (row stride (num_heads + 2·num_kv_heads)·head_dim floats, after RoPE) into `out` [len,
  // num_heads·head_dim]: every row, no window. What a benchmark times alone.
  kernels::PrefillAttentionParams PrefillAttentionOver(const float* qkv, float* out, int len) const;

  // LoadOptions::decode_graphs, changed between steps (a benchmark sets the two side by side).
  void SetDecodeGraphs(bool on);
  // Whether the next decode step would run as one graph (unless timed: DecodeTimes): graphs
  // on, the backend records them, and graphs have not failed on this model three steps in a
  // row.
  bool decode_graphs() const;

  // A KV cache for this model to decode: one region of host memory on a host backend; on a
  // device, pages of the model's own KV pool (LoadOptions::kv_pool_bytes), where the kernels
  // read it. A decode node makes its caches in its own pool instead (KvCache::CreateIn).
  absl::StatusOr<std::unique_ptr<KvCache>> NewCache(const KvCacheShape& shape);
  // Where NewCache's caches come from, for the state that goes with them (a sparse decode
  // selector's page summaries): the host's heap, or the model's KV pool on its device.
  absl::StatusOr<KvAllocator*> CacheAllocator();
  // The backend the model runs on (a decode node's KV pool is made in its memory).
  std::shared_ptr<kernels::KernelBackend> backend() const { return backend_; }
  bool on_device() const { return !backend_->host_addressable(); }

 private:
  struct Linear {
    const void* w = nullptr;
    DType dtype = DType::kF32;
    int out = 0, in = 0;
    const float* bias = nullptr;
  };
  struct Layer {
    std::vector<float> attn_norm, mlp_norm;
    const float* attn_norm_w = nullptr;  // the norms in the backend's memory
    const float* mlp_norm_w = nullptr;
    Linear q, k, v, o, gate, up, down;
    // q|k|v and gate|up as one matrix each, where the weights were placed in backend memory
    // (one product instead of three and two). w is null where the parts stay apart: a mapped
    // file's weights, or parts of different dtypes or input sizes.
    Linear qkv, gate_up;
  };
  // Memory of the backend (device memory on a GPU), freed with the model.
  struct BackendFree {
    kernels::KernelBackend* backend;
    void operator()(void* p) const { backend->Free(p); }
  };
  using BackendPtr = std::unique_ptr<void, BackendFree>;

  LlamaModel() = default;
  absl::Status LoadFromFolder(const std::string& dir, const LoadOptions& options);
  absl::Status LoadSynthetic(const std::string& spec, const LoadOptions& options);
  absl::StatusOr<Linear> LoadLinear(const std::string& name, int out, int in, bool bias);
  absl::StatusOr<std::vector<float>> LoadVector(const std::string& name, int n);
  const void* Own(std::vector<uint8_t> bytes);
  const float* OwnFloats(std::vector<float> values);
  absl::Status MatMul(const Linear& l, const float* x, int m, float* y, int64_t y_stride = 0);
  void EmbedRow(int32_t token, float* out) const;
  absl::StatusOr<BackendPtr> AllocateOnBackend(size_t bytes);
  // Copies the weights, norms and RoPE frequencies the kernels read into backend memory,
  // once (device memory on a GPU; huge-page host buffers on the host backends), unless
  // `mapped` (LoadOptions::mapped_weights): then the kernels read them where they are.
  absl::Status PlaceWeights(bool mapped);
  // On a GPU: the device copy of each input's cache, created and filled up to the rows the
  // host holds (a prompt received from prefill) as needed.
  absl::Status SyncDeviceCaches(absl::Span<const DecodeInput> batch);

  // The forward pass, in the pieces Prefill and DecodeStep share (llama_model.cc).
  struct Activations;
  absl::Status CheckTokens(absl::Span<const int32_t> ids) const;
  absl::Status CheckDecodeBatch(absl::Span<const DecodeInput> batch) const;
  absl::Status AttentionIn(const Layer& layer, Activations& a);
  absl::Status FirstNorm(Activations& a);
  absl::Status AttentionOutAndMlp(int layer, Activations& a);
  absl::Status DecodeAttentionLayer(int layer, absl::Span<const DecodeInput> batch, Activations& a,
                                    DecodeObserver* observer, DecodeTimes* times);
  absl::Status Logits(Activations& a, int first_row, float* logits);
  absl::StatusOr<std::unique_ptr<Activations>> MakeActivations(int rows, int chunk, int logit_rows,
                                                               bool sampling);
  absl::StatusOr<Activations*> DecodeActivations(absl::Span<const DecodeInput> batch);
  absl::Status DecodeLayers(absl::Span<const DecodeInput> batch, Activations& a,
                            DecodeObserver* observer, DecodeTimes* times);
  absl::Status RunDecodeOps(absl::Span<const DecodeInput> batch, bool graph,
                            const std::function<absl::Status()>& ops);
  // decode_graphs(), with decode_mu_ held.
  bool GraphsOn() const;
  absl::Status UploadInputs(Activations& a);
  // Rows of the embedding for `ids` into `out` (backend memory), looked up on the device.
  absl::Status EmbedOnDevice(absl::Span<const int32_t> ids, float* out);
  absl::Status DecodeAttentionLayerOnDevice(int layer, absl::Span<const DecodeInput> batch,
                                            Activations& a, DecodeTimes* times);

  void ComputeFingerprint();

  ModelConfig config_;
  std::string description_;
  std::string fingerprint_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<WeightFiles> files_;
  std::vector<std::vector<uint8_t>> owned_;
  std::vector<std::vector<float>> owned_floats_;
  DType weight_dtype_ = DType::kF32;
  Linear embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  const float* final_norm_w_ = nullptr;  // backend memory, as Layer's norms
  const float* inv_freq_w_ = nullptr;
  const void* embed_host_ = nullptr;    // the embedding rows on the host (EmbedRow)
  const void* embed_device_ = nullptr;  // a device backend's copy (EmbedOnDevice)
  // Shared with the device copies of caches (KvCache attachments), which free their memory
  // through it and may outlive the model.
  std::shared_ptr<kernels::KernelBackend> backend_;
  std::vector<BackendPtr> placed_;  // what PlaceWeights uploaded
  mutable std::mutex decode_mu_;
  std::unique_ptr<Activations> decode_activations_;  // under decode_mu_, reused across steps
  // Under decode_mu_: the steps in a row whose graph failed; at kGraphFailuresToStop, the
  // model's steps run op by op from then on.
  int graph_failures_ = 0;
  static constexpr int kGraphFailuresToStop = 3;
  LoadOptions options_;
  std::mutex pool_mu_;
  std::unique_ptr<KvPool> kv_pool_;  // under pool_mu_: NewCache's on a device
};

}  // namespace kvwire
