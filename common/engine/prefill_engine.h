// The prefill engine: a prompt through the model layer by layer, each layer's K/V
// compressed by the request's policy and written to a KV stream as soon as it is ready
// (layer l on its way while layer l+1 computes), then the first token sampled from the
// last position's logits and the trailer. Cancellation (the stream's reader went away) and
// the deadline are checked between layers.
//
// One engine serves all three callers of a prefill: the prefill node (its gRPC server
// translates requests and streams, nothing more), the decode node's local prefill of short
// prompts (through LocalKvSource), and the CLI (Generate, on the caller's thread).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/clock.h"
#include "common/compression/compression.h"
#include "common/engine/prefill_job.h"
#include "common/engine/prefix_cache.h"
#include "common/model/llama_model.h"
#include "common/telemetry/telemetry.h"
#include "common/wire/kv_stream.h"
#include "kernels/sampling.h"

namespace kvwire {

struct PrefillOutcome {
  WireTrailer trailer;        // as sent: first token, timings, counts
  std::vector<float> logits;  // of the last prompt position
};

// Runs prefills asynchronously: what the prefill node's server and the decode node's local
// KV source call. PrefillEngine implements it; tests wrap it to inject faults.
class PrefillExecutor {
 public:
  using Done = std::function<void(const absl::Status&)>;
  virtual ~PrefillExecutor() = default;
  // Queues a prefill whose stream goes to `sink`; `done` runs exactly once, after the
  // stream's last call, with the prefill's status. ResourceExhausted when the queue is
  // full and Unavailable when shutting down, and then `done` is not called.
  virtual absl::Status Submit(PrefillJob job, std::shared_ptr<KvStreamSink> sink, Done done) = 0;
};

struct PrefillEngineOptions {
  std::string node_name = "prefill";  // the trailer's `node`, and in messages
  int workers = 1;                    // prefills that run at once (0: Run only, no queue)
  int max_queue = 16;                 // prefills that may wait; more is ResourceExhausted
  Telemetry* telemetry = nullptr;     // metrics and traces of a prefill node (null: none)
  const Clock* clock = &Clock::Real();
  // The prefix cache (common/engine/prefix_cache.h): bytes it may hold (0: none), and tokens
  // per block.
  size_t prefix_cache_bytes = 0;
  int prefix_block_tokens = 64;
};

class PrefillEngine final : public PrefillExecutor {
 public:
  // `model` must outlive the engine. Starts the workers.
  PrefillEngine(LlamaModel* model, PrefillEngineOptions options);
  ~PrefillEngine() override;

  // One prefill on the caller's thread.
  absl::StatusOr<PrefillOutcome> Run(const PrefillJob& job, KvStreamSink& sink);

  absl::Status Submit(PrefillJob job, std::shared_ptr<KvStreamSink> sink, Done done) override;
  // Whether `job` is one this engine's model can run (Run checks it first): the model
  // fingerprint, the prompt's length and ids, the compression, the chunk size, sampling.
  absl::Status Check(const PrefillJob& job) const;
  // Refuses new work, finishes queued prefills with Unavailable, waits for running ones.
  void Shutdown();

  const LlamaModel& model() const { return *model_; }
  // Null without one (prefix_cache_bytes 0).
  const PrefixCache* prefix_cache() const { return prefix_cache_.get(); }
  const PrefillEngineOptions& options() const { return options_; }

 private:
  struct Queued;
  void WorkerLoop();

  LlamaModel* model_;
  PrefillEngineOptions options_;
  std::unique_ptr<PrefixCache> prefix_cache_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Queued>> queue_;
  bool stopping_ = false;
  int running_ = 0;
  std::vector<std::thread> workers_;
};

// The header a prefill of `len` prompt tokens under `config` sends, and what the receiving
// node expects of that stream (fixed before it starts).
WireHeader StreamHeader(const LlamaModel& model, const CompressionConfig& config, int len);
WireExpectation StreamExpectation(const LlamaModel& model, const CompressionConfig& config, int len,
                                  size_t max_chunk_bytes);

}  // namespace kvwire
