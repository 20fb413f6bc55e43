// The decode node's engine: admission against the KV pool, pulling each prompt's
// compressed cache from a KvSource (a prefill node, or this node's own model for short
// prompts), and a continuous batch in which every active sequence advances one token per
// step, new ones joining and finished ones leaving between steps. Everything here is in
// domain terms; decode_service/decode_server.cc translates the gRPC API and
// decode_service/grpc_kv_source.cc the Prefill RPC.
//
// Threads: one engine thread owns the batch and runs the decode steps; the sources'
// threads deliver KV streams (writing only into the cache that the sequence was given at
// admission); clients' threads submit and cancel. Time comes from an injectable Clock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/clock.h"
#include "common/compression/compression.h"
#include "common/engine/generate.h"
#include "common/engine/kv_source.h"
#include "common/model/kv_pool.h"
#include "common/model/llama_model.h"
#include "common/sparse/attention.h"
#include "common/telemetry/telemetry.h"
#include "kernels/sampling.h"

namespace kvwire {

struct GenerationJob {
  std::string request_id;
  std::string prompt_text;  // tokenized by the engine when prompt_ids is empty
  std::vector<int32_t> prompt_ids;
  int max_tokens = 16;
  kernels::SamplingParams sampling;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_ids;  // also the model's end-of-sequence ids unless ignore_eos
  CompressionConfig compression;
  DecodeAttentionConfig attention;
  bool logprobs = false;
  Clock::TimePoint deadline = Clock::TimePoint::max();  // on the engine's clock
  TraceContext trace;
};

struct TokenDelta {
  std::vector<int32_t> ids;
  std::string text;
  std::vector<float> logprobs;
};

struct RequestFigures {
  int prompt_tokens = 0, completion_tokens = 0, kept_tokens = 0;
  int cached_tokens = 0;  // the prefill node's prefix cache hit
  int64_t full_cache_bytes = 0, wire_bytes = 0;
  int64_t kv_payload_bytes = 0;  // positions, K and V of the kept rows (the trailer's count)
  double transfer_ms = 0, prefill_ms = 0, queue_ms = 0, ttft_ms = 0, mean_itl_ms = 0;
  std::string policy, prefill_node, decode_node, attention;
  int prefill_attempts = 0;
  FinishReason finish = FinishReason::kLength;
};

// Where a request's output goes: the client stream. Thread-safe; Finish exactly once.
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  virtual bool Send(TokenDelta delta) = 0;  // false once the client is gone
  virtual void Finish(const absl::Status& status, const RequestFigures* figures) = 0;
  virtual bool cancelled() const = 0;
};

struct DecodeEngineOptions {
  std::string node_name = "decode";
  int max_batch = 32;            // sequences being prefilled or decoded at once
  int max_queue = 64;            // requests waiting for admission; more is refused
  int queue_timeout_ms = 30000;  // longest wait for KV pool room
  // Remote prefills. A failed attempt (the node died, hung or broke the stream) is retried
  // after a jittered backoff, up to `prefill_attempts` tries; an attempt that runs longer
  // than `prefill_attempt_timeout_ms` has failed. A full prefill tier (every node's queue
  // full: RESOURCE_EXHAUSTED) costs no attempt: the request waits, retrying, for up to
  // `prefill_wait_ms` within its deadline.
  int prefill_attempts = 3;
  int prefill_attempt_timeout_ms = 60000;
  int prefill_wait_ms = 30000;
  int prefill_backoff_ms = 25;  // first retry's mean delay; doubles, up to 16x
  int local_prefill_below = 0;  // prompts shorter than this prefill on `local`
  size_t max_chunk_bytes = kDefaultMaxChunkBytes;
  // Where prompts' KV comes from: `remote` (prefill nodes) unless the prompt is short or
  // there is none, else `local`. At least one must be set.
  KvSource* remote = nullptr;
  KvSource* local = nullptr;
  Telemetry* telemetry = nullptr;
  const Clock* clock = &Clock::Real();
};

class DecodeEngine {
 public:
  DecodeEngine(LlamaModel* model, KvPool* pool, DecodeEngineOptions options);
  ~DecodeEngine();

  // Queues a request. ResourceExhausted when the queue is full; everything else (a bad
  // prompt, no room) arrives through the sink.
  absl::Status Submit(GenerationJob job, std::shared_ptr<ResponseSink> sink);
  // Wakes the engine (a client cancelled, memory came back, time moved on).
  void Wake();
  // Stops admitting; finishes queued requests with UNAVAILABLE; waits up to `grace` for the
  // running ones (the destructor, not this, ends any still running).
  void Drain(std::chrono::milliseconds grace);

  int active() const;
  int queued() const;

 private:
  struct Seq;
  class Receiver;
  // A sequence leaving the engine: decided under the lock, finished (memory back, then the
  // client's Finish) after it, so that no pool or sink callback runs under the lock.
  struct Ending {
    std::shared_ptr<Seq> seq;
    absl::Status status;
    std::optional<RequestFigures> figures;
  };
  void Loop();
  void Admit(std::vector<Ending>* endings);
  absl::Status Prepare(Seq& s);
  absl::StatusOr<std::unique_ptr<KvCache>> NewCache(const KvCacheShape& shape);
  void StartPrefill(const std::shared_ptr<Seq>& s);
  // Prefills that wait for their retry time: started when it comes, ended if their client
  // left or their deadline passed meanwhile (under the lock).
  void StartDueRetries(std::vector<Ending>* endings);
  bool Retry(Seq& s, const absl::Status& st);
  // What the client hears of a prefill that failed for good.
  absl::Status PrefillFailure(const Seq& s, const absl::Status& st) const;
  Clock::TimePoint::duration RetryDelay(int retry);
  void OnPrefillDone(std::shared_ptr<Seq> s, absl::Status status);
  void HandlePrefillsDone(std::vector<Ending>* endings);
  void ExpireInFlight(std::vector<Ending>* endings);
  // Emits a token to the client; true when the sequence is now finished.
  bool Emit(Seq& s, int32_t token, float logprob);
  // One decode step of the batch; the sequences it ended, with how.
  std::vector<std::pair<std::shared_ptr<Seq>, absl::Status>> Step();
  // Figures and telemetry of a sequence that ends (under the lock).
  void Complete(const std::shared_ptr<Seq>& s, const absl::Status& status,
                std::vector<Ending>* endings);
  void Finish(std::vector<Ending>* endings);
  // A cache whose pages a prefill node may still be writing (cuda_ipc: an attempt that did not
  // end with its whole stream) is held until that attempt's deadline has passed, past which the
  // prefill node writes nothing (its lease), so that no other sequence gets those pages.
  void Quarantine(Seq& s);
  void ReleaseQuarantine();

  LlamaModel* model_;
  KvPool* pool_;
  DecodeEngineOptions options_;
  const Clock& clock_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Seq>> waiting_;      // not yet admitted
  std::vector<std::shared_ptr<Seq>> prefilling_;  // admitted, KV arriving
  std::vector<std::shared_ptr<Seq>> running_;     // decoding
  std::vector<std::pair<std::shared_ptr<Seq>, absl::Status>> prefill_done_;
  int finishing_ = 0;                // ended sequences whose clients have not heard yet
  std::minstd_rand jitter_{0x6b76};  // retry backoff jitter
  bool stopping_ = false, draining_ = false;
  std::atomic<bool> wake_{false};
  std::mutex quarantine_mu_;
  std::vector<std::pair<Clock::TimePoint, std::unique_ptr<KvCache>>> quarantine_;
  std::thread loop_;
};

}  // namespace kvwire
