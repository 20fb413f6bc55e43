#include "common/engine/decode_engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/engine/prefill_engine.h"
#include "common/engine/stop_matcher.h"
#include "common/sparse/rocketkv.h"
#include "common/wire/kv_wire.h"

namespace kvwire {
namespace {

// A KV stream the assembler rejects is its source's fault, not the client's request: the
// client must not hear INVALID_ARGUMENT for it.
absl::Status StreamFault(const absl::Status& st, bool local) {
  if (st.code() != absl::StatusCode::kInvalidArgument) return st;
  return absl::InternalError(
      absl::StrCat(local ? "from the local prefill: " : "from the prefill node: ", st.message()));
}

// Worth retrying on another prefill node: the node or the path failed, not the request.
bool Retryable(const absl::Status& st) {
  switch (st.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kCancelled:  // the node went away mid-stream
      return true;
    default:
      return false;
  }
}

// A status only the prefill node's server sends, and that it sends before it writes a byte when
// no header came first (a refusal: a full queue, a request it cannot serve); the client library
// makes the others itself (a cancellation, a deadline, a broken connection).
bool RefusedBeforeWriting(const absl::Status& st) {
  switch (st.code()) {
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kNotFound:
      return true;
    default:
      return false;
  }
}

}  // namespace

struct DecodeEngine::Seq {
  GenerationJob job;
  std::shared_ptr<ResponseSink> sink;
  Clock::TimePoint arrival;
  Span span, queue_span, prefill_span, transfer_span, generate_span;

  // Set at admission.
  KvCacheShape shape;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<DecodeSelector> selector;
  size_t reserve_bytes = 0;  // KV pool bytes the request needs (cache + page summaries)

  // Prefill: touched by the source's thread of the current attempt until it is done.
  KvSource* source = nullptr;
  bool local = false;  // prefilled on this node
  std::unique_ptr<KvAssembler> assembler;
  std::shared_ptr<KvTransfer> transfer;
  int attempts = 0;  // that failed or are running; a full tier's refusals not counted
  bool awaiting_retry = false;
  bool reached = false;     // the current attempt received its stream's header
  int tries = 0;            // attempts started (the next retry's backoff exponent: tries - 1)
  absl::Status last_error;  // of the attempt that failed, while a retry waits
  Clock::TimePoint retry_at, waiting_since = Clock::TimePoint::max();
  bool tier_full = false;  // the last refusal was a full queue (else: no node reachable)
  Clock::TimePoint admitted, first_kv, trailer_at;
  Clock::TimePoint attempt_deadline;  // the current attempt's (the prefill node's lease)
  bool attempt_refused = false;       // it ended refused by the node, before any header
  WireTrailer trailer;
  int64_t wire_bytes = 0;

  // Generation state: the first token is emitted by whoever completes the prefill, then
  // only by the engine thread.
  std::unique_ptr<SamplingRng> rng;
  std::unique_ptr<StreamingDecoder> decoder;
  std::unique_ptr<StopMatcher> stop;
  std::vector<int32_t> generated;
  bool finished = false;
  FinishReason finish = FinishReason::kLength;
  Clock::TimePoint first_token_at, last_token_at;
  double itl_sum_ms = 0;
  int itl_count = 0;
};

// One attempt's stream, into the sequence's cache: the assembler checks every message, the
// trailer's first token goes to the client at once, and the end goes back to the engine.
class DecodeEngine::Receiver final : public KvReceiver {
 public:
  Receiver(DecodeEngine* engine, std::shared_ptr<Seq> seq)
      : engine_(engine), seq_(std::move(seq)) {}

  absl::Status OnHeader(const WireHeader& h) override {
    Seq& s = *seq_;
    s.first_kv = engine_->clock_.Now();
    s.reached = true;
    if (Telemetry* t = engine_->options_.telemetry) {
      s.transfer_span = t->StartSpan("decode.kv_transfer", s.prefill_span.context());
      s.transfer_span.SetAttribute("policy", h.policy);
      s.transfer_span.SetAttribute("kv.transport", std::string(s.source->name()));
      s.transfer_span.SetAttribute("kv.kept_tokens",
                                   h.kept_per_layer.empty() ? 0 : h.kept_per_layer.back());
    }
    return Settled(StreamFault(s.assembler->OnHeader(h), s.local), /*last=*/false);
  }
  absl::Status OnChunk(WireChunk chunk) override {
    return Settled(StreamFault(seq_->assembler->OnChunk(chunk), seq_->local), /*last=*/false);
  }
  absl::Status OnTrailer(const WireTrailer& t) override {
    Seq& s = *seq_;
    RETURN_IF_ERROR(Settled(
        StreamFault(s.assembler->OnTrailer(t, engine_->model_->config().vocab_size), s.local),
        /*last=*/true));
    s.trailer = t;
    s.trailer_at = engine_->clock_.Now();
    // The first token goes to the client now, not at the next decode step. Its random
    // draw was the prefill's; this keeps the local generator in step.
    s.rng->Uniform();
    engine_->Emit(s, t.first_token, t.first_logprob);
    return absl::OkStatus();
  }
  KvCache* destination() override { return seq_->cache.get(); }
  absl::Status CheckChunk(const WireChunk& chunk) override {
    return StreamFault(seq_->assembler->CheckNext(chunk), seq_->local);
  }
  void OnDone(const absl::Status& status, int64_t transport_bytes) override {
    // A local prefill that failed before its trailer left its copies queued (see Settled).
    if (!status.ok() && seq_->local) (void)Settled(absl::OkStatus(), /*last=*/true);
    std::shared_ptr<Seq> s = std::move(seq_);
    s->wire_bytes += transport_bytes;
    // The transfer: first KV byte to the end of the stream, with what it carried.
    s->transfer_span.SetAttribute("kv.wire_bytes", transport_bytes);
    s->transfer_span.SetAttribute("kv.full_bytes", s->trailer.full_cache_bytes);
    s->transfer_span.SetAttribute("kv.chunks", s->trailer.chunks);
    s->transfer_span.SetError(s->assembler->complete() ? absl::OkStatus() : status);
    s->transfer_span.End();
    engine_->OnPrefillDone(std::move(s), status);  // no reference kept past the hand-over
  }

 private:
  // `st`, once the copies this call queued into a device cache have landed. A transport calls
  // the entries on its own threads (gRPC's, a chunk on any of them), each queuing on its own
  // stream, and the decode loop reads the cache on another: a device orders nothing between
  // streams, so each entry waits for its own work before it returns. A local prefill calls
  // every entry, and OnDone, on its one thread, inside its forward: it waits once, at the
  // `last` (a wait per chunk would also wait for the layer computing meanwhile). A failed wait
  // is this node's device, not the prefill's: no other prefill node would do better.
  absl::Status Settled(absl::Status st, bool last) {
    KvCache* cache = seq_ ? seq_->cache.get() : nullptr;
    if (cache == nullptr || cache->host_rows() || (seq_->local && !last)) return st;
    if (absl::Status sync = cache->backend()->Synchronize(); !sync.ok()) {
      st.Update(absl::FailedPreconditionError(
          absl::StrCat("this decode node's device, writing the received cache: ", sync.message())));
    }
    return st;
  }

  DecodeEngine* engine_;
  std::shared_ptr<Seq> seq_;
};

DecodeEngine::DecodeEngine(LlamaModel* model, KvPool* pool, DecodeEngineOptions options)
    : model_(model), pool_(pool), options_(std::move(options)), clock_(*options_.clock) {
  // Every prompt has a source: the local one for short prompts (or all, without a remote).
  KVWIRE_CHECK(options_.local != nullptr ||
               (options_.remote != nullptr && options_.local_prefill_below == 0));
  loop_ = std::thread([this] { Loop(); });
}

DecodeEngine::~DecodeEngine() {
  Drain(std::chrono::milliseconds(0));
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    wake_ = true;
  }
  cv_.notify_all();
  loop_.join();
}

int DecodeEngine::active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(prefilling_.size() + running_.size());
}

int DecodeEngine::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(waiting_.size());
}

// Lock-free, because it is called where the engine's lock may be held (memory going back
// to the pool). The loop's wait has a 20 ms timeout, so a wake-up that slips in just before
// it starts waiting costs at most that.
void DecodeEngine::Wake() {
  wake_.store(true);
  cv_.notify_all();
}

absl::Status DecodeEngine::Submit(GenerationJob job, std::shared_ptr<ResponseSink> sink) {
  auto s = std::make_shared<Seq>();
  s->job = std::move(job);
  s->sink = std::move(sink);
  s->arrival = clock_.Now();
  if (options_.telemetry) {
    s->span = options_.telemetry->StartSpan("decode.request", s->job.trace);
    s->span.SetAttribute("request_id", s->job.request_id);
    s->queue_span = options_.telemetry->StartSpan("decode.queue", s->span.context());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) return absl::UnavailableError("decode node is shutting down");
    if (static_cast<int>(waiting_.size()) >= options_.max_queue) {
      return absl::ResourceExhaustedError(
          absl::StrCat("decode node ", options_.node_name, " is full: ", waiting_.size(),
                       " requests waiting for admission (--max-queue ", options_.max_queue, ")"));
    }
    waiting_.push_back(std::move(s));
    wake_ = true;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

void DecodeEngine::Drain(std::chrono::milliseconds grace) {
  std::deque<std::shared_ptr<Seq>> refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
    refused.swap(waiting_);
  }
  for (auto& s : refused) {
    s->sink->Finish(absl::UnavailableError("decode node is shutting down"), nullptr);
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, grace,
               [&] { return prefilling_.empty() && running_.empty() && finishing_ == 0; });
}

// Tokenizes and checks what needs the model, sizes the cache and reserves it.
absl::Status DecodeEngine::Prepare(Seq& s) {
  const ModelConfig& mc = model_->config();
  GenerationJob& j = s.job;
  if (j.prompt_ids.empty()) {
    ASSIGN_OR_RETURN(j.prompt_ids, model_->tokenizer().Encode(j.prompt_text));
    if (j.prompt_ids.empty()) {
      return AboutField(absl::InvalidArgumentError("prompt: encodes to no tokens"), "prompt");
    }
  }
  const int len = static_cast<int>(j.prompt_ids.size());
  RETURN_IF_ERROR(ResolveTwoStage(&j.compression, &j.attention, len, j.max_tokens, mc.head_dim));
  if (len + j.max_tokens > mc.context_limit()) {
    return AboutField(absl::InvalidArgumentError(
                          absl::StrCat("prompt (", len, " tokens) + max_tokens (", j.max_tokens,
                                       ") exceeds the model's context of ", mc.context_limit())),
                      "sampling.max_tokens");
  }
  KvCacheShape shape =
      CompressedCacheShape(j.compression, mc, model_->kv_dtype(), len, j.max_tokens);
  shape.format = DecodeCacheFormat(j.compression.kv_format);
  ASSIGN_OR_RETURN(const size_t selector_bytes, DecodeSelectorBytes(j.attention, mc, shape));
  s.reserve_bytes = pool_->BytesFor(shape) + selector_bytes;
  if (!pool_->CanEverFit(s.reserve_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", s.reserve_bytes, " bytes of KV cache but the pool holds ",
        pool_->capacity(), " (--kv-pool-bytes); lower max_tokens or the compression budget"));
  }
  // Everything is allocated before anything is kept, so a request that must wait holds no
  // memory while it waits.
  // On a device backend the cache is pages of the pool's slab in device memory, where the wire
  // writes the prompt's rows and decode appends.
  ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, NewCache(shape));
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeSelector> selector,
                   MakeDecodeSelector(j.attention, mc, shape, *pool_));
  s.shape = shape;
  s.cache = std::move(cache);
  s.selector = std::move(selector);
  s.cache->set_prompt_len(len);
  s.rng = std::make_unique<SamplingRng>(j.seed);
  s.decoder = std::make_unique<StreamingDecoder>(model_->tokenizer());
  RETURN_IF_ERROR(s.decoder->Prime(j.prompt_ids));
  s.stop = std::make_unique<StopMatcher>(j.stop);
  return absl::OkStatus();
}

void DecodeEngine::Quarantine(Seq& s) {
  if (s.cache == nullptr || s.source == nullptr || !s.source->leases_cache() ||
      (s.assembler && s.assembler->complete()) || s.attempt_refused) {
    s.cache.reset();
    return;
  }
  // The prefill node checks its lease before each write, on this host's clock; a write that
  // began just before it takes milliseconds.
  constexpr auto kWriteGrace = std::chrono::seconds(1);
  std::lock_guard<std::mutex> lock(quarantine_mu_);
  quarantine_.emplace_back(s.attempt_deadline + kWriteGrace, std::move(s.cache));
}

void DecodeEngine::ReleaseQuarantine() {
  std::vector<std::unique_ptr<KvCache>> done;  // freed outside the lock (the pool's callback)
  {
    std::lock_guard<std::mutex> lock(quarantine_mu_);
    const auto now = clock_.Now();
    for (auto it = quarantine_.begin(); it != quarantine_.end();) {
      if (it->first > now) {
        ++it;
        continue;
      }
      done.push_back(std::move(it->second));
      it = quarantine_.erase(it);
    }
  }
}

void DecodeEngine::Admit(std::vector<Ending>* endings) {
  // Requests that were cancelled or ran out of time while waiting leave the queue now, not
  // when they reach its head, so they do not hold queue slots.
  const auto now = clock_.Now();
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const bool cancelled = (*it)->sink->cancelled();
    if (!cancelled && now <= (*it)->job.deadline) {
      ++it;
      continue;
    }
    endings->push_back({*it,
                        cancelled ? absl::CancelledError("cancelled while queued")
                                  : absl::DeadlineExceededError("deadline passed while queued"),
                        std::nullopt});
    it = waiting_.erase(it);
  }
  // FIFO: the head waits for room rather than letting later, smaller requests starve it.
  while (!waiting_.empty()) {
    std::shared_ptr<Seq> s = waiting_.front();
    if (static_cast<int>(prefilling_.size() + running_.size()) >= options_.max_batch) return;
    absl::Status st = Prepare(*s);
    if (st.code() == absl::StatusCode::kResourceExhausted && pool_->CanEverFit(s->reserve_bytes)) {
      if (Milliseconds(clock_.Now() - s->arrival) <= options_.queue_timeout_ms) return;  // wait
      st = absl::ResourceExhaustedError(absl::StrCat(
          "waited ", options_.queue_timeout_ms, " ms for ", s->reserve_bytes, " bytes of KV pool; ",
          pool_->used(), " of ", pool_->capacity(), " are in use"));
    }
    waiting_.pop_front();
    if (!st.ok()) {
      endings->push_back({s, st, std::nullopt});
      continue;
    }
    s->queue_span.End();
    s->admitted = clock_.Now();
    prefilling_.push_back(s);
    s->local = options_.remote == nullptr ||
               static_cast<int>(s->job.prompt_ids.size()) < options_.local_prefill_below;
    s->source = s->local ? options_.local : options_.remote;
    StartPrefill(s);
  }
}

// A sequence's cache: where a prefill node writes rows and positions itself (shm), a shared
// region of the host pool; else the pool's memory (pages on a device, where cuda_ipc writes).
absl::StatusOr<std::unique_ptr<KvCache>> DecodeEngine::NewCache(const KvCacheShape& shape) {
  if (options_.remote != nullptr &&
      options_.remote->placement() == KvPlacement::kRowsAndPositions) {
    SharedKvAllocator shared(*pool_);
    return KvCache::Create(shape, shared);
  }
  return KvCache::CreateIn(shape, *pool_);
}

// Starts one prefill attempt; a source that refuses at once is an attempt that failed.
void DecodeEngine::StartPrefill(const std::shared_ptr<Seq>& s) {
  ++s->attempts;
  ++s->tries;
  s->reached = false;
  if (s->tries > 1 && s->source->placement() != KvPlacement::kNone) {
    // A node that failed may still be writing into the last attempt's cache: the retry gets a
    // cache of its own (a region's memory goes with that node's mapping; pages wait out the
    // failed attempt's lease in quarantine).
    const int prompt_len = s->cache->prompt_len();
    Quarantine(*s);
    auto fresh = NewCache(s->shape);
    if (!fresh.ok()) {
      prefill_done_.emplace_back(s, fresh.status());
      wake_ = true;
      return;
    }
    s->cache = std::move(*fresh);
    s->cache->set_prompt_len(prompt_len);
  }
  for (int l = 0; l < s->cache->num_layers(); ++l) s->cache->layer(l).len = 0;
  const int len = static_cast<int>(s->job.prompt_ids.size());
  WireExpectation expect =
      StreamExpectation(*model_, s->job.compression, len, options_.max_chunk_bytes);
  expect.placement = s->source->placement();
  s->assembler = std::make_unique<KvAssembler>(std::move(expect), s->cache.get());

  PrefillJob job;
  job.attempt = s->tries - 1;
  job.request_id = s->job.request_id;
  job.prompt_ids = s->job.prompt_ids;
  job.compression = s->job.compression;
  job.model_fingerprint = model_->fingerprint();
  job.max_chunk_bytes = options_.max_chunk_bytes;
  job.sampling = s->job.sampling;
  job.seed = s->job.seed;
  job.deadline =
      s->local
          ? s->job.deadline
          : std::min(s->job.deadline,
                     clock_.Now() + std::chrono::milliseconds(options_.prefill_attempt_timeout_ms));
  if (options_.telemetry) {
    s->prefill_span = options_.telemetry->StartSpan(
        s->local ? "decode.prefill_local" : "decode.prefill_rpc", s->span.context());
    s->prefill_span.SetAttribute("attempt", s->attempts);
  }
  job.trace = s->prefill_span.context().valid() ? s->prefill_span.context() : s->job.trace;
  s->attempt_deadline = job.deadline;
  s->attempt_refused = false;
  auto transfer = s->source->Start(std::move(job), std::make_shared<Receiver>(this, s));
  if (transfer.ok()) {
    s->transfer = std::move(*transfer);
    if (const std::string route = s->transfer->route(); !route.empty()) {
      s->prefill_span.SetAttribute("prefill.route", route);
      if (const std::string node = s->transfer->node(); !node.empty()) {
        s->prefill_span.SetAttribute("prefill.node", node);
      }
      if (options_.telemetry) options_.telemetry->CountRoute(route);
    }
  } else {
    prefill_done_.emplace_back(s, transfer.status());  // handled by the loop's next turn
    wake_ = true;
  }
}

void DecodeEngine::OnPrefillDone(std::shared_ptr<Seq> s, absl::Status status) {
  // A complete stream counts even if the call then failed: the cache is whole.
  if (s->assembler && s->assembler->complete()) status = absl::OkStatus();
  // Notified under the lock: once it is released the engine may finish and be destroyed,
  // and this (source) thread must not touch it after that.
  std::lock_guard<std::mutex> lock(mu_);
  prefill_done_.emplace_back(std::move(s), status);
  wake_ = true;
  cv_.notify_all();
}

bool DecodeEngine::Emit(Seq& s, int32_t token, float logprob) {
  const auto now = clock_.Now();
  if (s.generated.empty()) {
    s.first_token_at = now;
  } else {
    const double itl = Milliseconds(now - s.last_token_at);
    s.itl_sum_ms += itl;
    ++s.itl_count;
    if (options_.telemetry) options_.telemetry->ObserveItl(itl / 1e3);
  }
  s.last_token_at = now;
  s.generated.push_back(token);
  TokenDelta delta;
  delta.ids.push_back(token);
  if (s.job.logprobs) delta.logprobs.push_back(logprob);
  auto text = s.decoder->Push(token);
  delta.text = s.stop->Push(text.ok() ? *text : "");
  const bool stop_id =
      std::find(s.job.stop_ids.begin(), s.job.stop_ids.end(), token) != s.job.stop_ids.end();
  if (s.stop->stopped() || stop_id) {
    s.finished = true;
    s.finish = FinishReason::kStop;
  } else if (static_cast<int>(s.generated.size()) >= s.job.max_tokens) {
    s.finished = true;
    s.finish = FinishReason::kLength;
  }
  if (s.finished && !s.stop->stopped())
    delta.text += s.stop->Push(s.decoder->Flush()) + s.stop->Flush();
  s.sink->Send(std::move(delta));
  return s.finished;
}

void DecodeEngine::Complete(const std::shared_ptr<Seq>& s, const absl::Status& status,
                            std::vector<Ending>* endings) {
  const ModelConfig& mc = model_->config();
  RequestFigures f;
  f.prompt_tokens = static_cast<int>(s->job.prompt_ids.size());
  f.completion_tokens = static_cast<int>(s->generated.size());
  f.kept_tokens = s->job.compression.KeptTokens(s->job.compression.skip_layers, f.prompt_tokens);
  f.full_cache_bytes = int64_t{f.prompt_tokens} * mc.KvBytesPerToken(model_->kv_dtype());
  f.wire_bytes = s->wire_bytes;
  f.kv_payload_bytes = s->trailer.kv_payload_bytes;
  f.transfer_ms = s->local ? 0 : Milliseconds(s->trailer_at - s->first_kv);
  f.prefill_ms = s->trailer.forward_ms;
  f.queue_ms = Milliseconds(s->admitted - s->arrival);
  f.ttft_ms = Milliseconds(s->first_token_at - s->arrival);
  f.mean_itl_ms = s->itl_count ? s->itl_sum_ms / s->itl_count : 0;
  f.policy = s->job.compression.Describe();
  f.prefill_node = s->trailer.node;
  f.cached_tokens = s->trailer.cached_tokens;
  f.decode_node = options_.node_name;
  f.attention = s->job.attention.Describe();
  f.prefill_attempts = s->attempts;
  f.finish = s->finish;
  if (Telemetry* t = options_.telemetry) {
    t->CountRequest(status);
    t->ObserveRequest(Milliseconds(clock_.Now() - s->arrival) / 1e3);
    if (!s->generated.empty()) t->ObserveTtft(f.ttft_ms / 1e3);
    t->CountTokens(f.prompt_tokens, f.completion_tokens);
    s->span.SetAttribute("kv.full_bytes", f.full_cache_bytes);
    s->span.SetAttribute("kv.wire_bytes", f.wire_bytes);
    s->span.SetAttribute("kv.kept_tokens", f.kept_tokens);
    s->span.SetAttribute("policy", f.policy);
    s->span.SetAttribute("budget", s->job.compression.EffectiveBudget(f.prompt_tokens));
    s->span.SetAttribute("completion_tokens", f.completion_tokens);
    s->span.SetAttribute("ttft_ms", f.ttft_ms);
    s->generate_span.SetAttribute("completion_tokens", f.completion_tokens);
    s->generate_span.SetAttribute("mean_itl_ms", f.mean_itl_ms);
    s->generate_span.SetError(status);
    s->generate_span.End();
    s->span.SetError(status);
    s->span.End();
  }
  endings->push_back({s, status, status.ok() ? std::optional<RequestFigures>(f) : std::nullopt});
}

// Outside the lock: the memory goes back to the pool before the client hears the end (a
// client that sends its next request at once finds the room), then the client's Finish.
void DecodeEngine::Finish(std::vector<Ending>* endings) {
  if (endings->empty()) return;
  for (Ending& e : *endings) {
    e.seq->selector.reset();
    Quarantine(*e.seq);
    e.seq->cache.reset();
    e.seq->sink->Finish(e.status, e.figures ? &*e.figures : nullptr);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    finishing_ -= static_cast<int>(endings->size());
  }
  cv_.notify_all();  // Drain waits for the last one
  endings->clear();
}

std::vector<std::pair<std::shared_ptr<DecodeEngine::Seq>, absl::Status>> DecodeEngine::Step() {
  // The batch: every running sequence, oldest first, up to max_batch.
  std::vector<std::shared_ptr<Seq>> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : running_) {
      if (static_cast<int>(batch.size()) >= options_.max_batch) break;
      batch.push_back(s);
    }
  }
  std::vector<std::pair<std::shared_ptr<Seq>, absl::Status>> ended;
  // A sequence whose cache the model cannot take (a GPU out of memory for its device copy)
  // ends alone, before the step, instead of failing everyone's.
  for (auto it = batch.begin(); it != batch.end();) {
    if (absl::Status st = model_->PrepareForDecode(*(*it)->cache); !st.ok()) {
      (*it)->finished = true;
      ended.emplace_back(*it, st);
      it = batch.erase(it);
    } else {
      ++it;
    }
  }
  if (batch.empty()) return ended;
  std::vector<DecodeInput> inputs;
  std::vector<kernels::SampleRow> rows;
  for (auto& s : batch) {
    DecodeInput in;
    in.token = s->generated.back();
    in.position = s->cache->prompt_len() + static_cast<int>(s->generated.size()) - 1;
    in.cache = s->cache.get();
    in.selector = s->selector.get();
    inputs.push_back(in);
    rows.push_back({s->job.sampling, s->rng->Uniform()});
  }
  // Sampled by the model's backend: on a GPU only the tokens come back, not the logits.
  std::vector<kernels::SampledToken> tokens(batch.size());
  const absl::Status st = model_->DecodeStepSampled(inputs, rows, tokens.data());
  for (size_t b = 0; b < batch.size(); ++b) {
    Seq& s = *batch[b];
    if (!st.ok()) {
      s.finished = true;
      ended.emplace_back(batch[b], st);
      continue;
    }
    if (Emit(s, tokens[b].id, tokens[b].logprob)) ended.emplace_back(batch[b], absl::OkStatus());
  }
  return ended;
}

// Prefills that ended (under the lock): join the batch, retry elsewhere, or fail.
void DecodeEngine::HandlePrefillsDone(std::vector<Ending>* endings) {
  auto done = std::move(prefill_done_);
  prefill_done_.clear();
  for (auto& [s, st] : done) {
    s->transfer.reset();
    s->attempt_refused = !st.ok() && !s->reached && RefusedBeforeWriting(st);
    s->prefill_span.SetError(st);
    s->prefill_span.End();
    Telemetry* t = options_.telemetry;
    if (st.ok() && t) {
      t->CountTransfer(std::string(s->source->name()),
                       std::string(s->job.compression.policy_name()), s->trailer.full_cache_bytes,
                       s->wire_bytes);
      if (!s->local) t->ObserveTransfer(Milliseconds(s->trailer_at - s->first_kv) / 1e3);
    }
    if (st.ok() && s->finished) {  // the first token already ended it
      std::erase(prefilling_, s);
      Complete(s, absl::OkStatus(), endings);
    } else if (st.ok()) {
      std::erase(prefilling_, s);
      running_.push_back(s);
      if (t) {
        s->generate_span = t->StartSpan("decode.generate", s->span.context());
        s->generate_span.SetAttribute("attention", s->job.attention.Describe());
      }
    } else if (Retry(*s, st)) {
      if (t) t->CountTransferFailure(StatusLabel(st));
      s->awaiting_retry = true;
      s->retry_at = clock_.Now() + RetryDelay(s->tries - 1);
      s->last_error = st;
    } else {
      if (t && !s->local) t->CountTransferFailure(StatusLabel(st));
      std::erase(prefilling_, s);
      Complete(s, PrefillFailure(*s, st), endings);
    }
  }
}

// Whether a failed remote attempt is tried again (under the lock).
bool DecodeEngine::Retry(Seq& s, const absl::Status& st) {
  const auto now = clock_.Now();
  if (s.local || s.sink->cancelled() || draining_ || stopping_ || now >= s.job.deadline) {
    return false;
  }
  // No node took the request: every node's queue was full, or none could be reached (all
  // down, restarting, or the balancer has not yet seen one come back). Not an attempt: the
  // request waits, retrying, for a node with room.
  if (st.code() == absl::StatusCode::kResourceExhausted ||
      (st.code() == absl::StatusCode::kUnavailable && !s.reached)) {
    --s.attempts;
    if (s.waiting_since == Clock::TimePoint::max()) s.waiting_since = now;
    s.tier_full = st.code() == absl::StatusCode::kResourceExhausted;
    return now < s.waiting_since + std::chrono::milliseconds(options_.prefill_wait_ms);
  }
  // The attempt's own timeout (not the request's deadline, which has time left).
  const bool attempt_timeout = st.code() == absl::StatusCode::kDeadlineExceeded;
  return (Retryable(st) || attempt_timeout) && s.attempts < options_.prefill_attempts;
}

absl::Status DecodeEngine::PrefillFailure(const Seq& s, const absl::Status& st) const {
  absl::Status final = st;
  const bool waited = s.waiting_since != Clock::TimePoint::max() && !s.local;
  if (s.sink->cancelled()) {
    final = absl::CancelledError("cancelled by the client");
  } else if (clock_.Now() >= s.job.deadline) {
    final = absl::DeadlineExceededError(
        !waited       ? "deadline passed during prefill"
        : s.tier_full ? "deadline passed while waiting for prefill capacity (every prefill "
                        "node's queue was full)"
                      : "deadline passed while waiting for a reachable prefill node");
  } else if (waited && (st.code() == absl::StatusCode::kResourceExhausted ||
                        st.code() == absl::StatusCode::kUnavailable)) {
    final = absl::Status(
        st.code(),
        absl::StrCat(s.tier_full ? "the prefill tier is full: no prefill node took the request"
                                 : "no prefill node could be reached",
                     " for ", options_.prefill_wait_ms,
                     " ms (--prefill-wait-ms); last error: ", st.message()));
  }
  // Attempts that reached a node; the tries no node took (full or unreachable) apart.
  const int refused = s.tries - s.attempts;
  return Annotate(final,
                  absl::StrCat("prefill (", s.attempts, " attempt", s.attempts == 1 ? "" : "s",
                               refused > 0 ? absl::StrCat(", ", refused, " refused") : "", ")"));
}

Clock::TimePoint::duration DecodeEngine::RetryDelay(int retry) {
  // Full jitter (uniform in [0, 2·mean)): retries of many requests that failed together
  // spread out instead of arriving at once. The mean stops growing after 4 doublings, so
  // a request that has waited long retries as often as a new one.
  const double mean = options_.prefill_backoff_ms * static_cast<double>(1 << std::min(retry, 4));
  std::uniform_real_distribution<double> u(0.0, 2.0 * mean);
  return std::chrono::duration_cast<Clock::TimePoint::duration>(
      std::chrono::duration<double, std::milli>(u(jitter_)));
}

void DecodeEngine::StartDueRetries(std::vector<Ending>* endings) {
  const auto now = clock_.Now();
  // In admission order, so that the oldest of the requests due goes first.
  std::vector<std::shared_ptr<Seq>> ended;
  for (const std::shared_ptr<Seq>& s : prefilling_) {
    if (!s->awaiting_retry) continue;
    if (s->sink->cancelled() || now >= s->job.deadline || stopping_ || draining_) {
      ended.push_back(s);
    } else if (now >= s->retry_at) {
      s->awaiting_retry = false;
      StartPrefill(s);
    }
  }
  for (const std::shared_ptr<Seq>& s : ended) {
    std::erase(prefilling_, s);
    Complete(
        s,
        PrefillFailure(*s, stopping_ || draining_ ? absl::UnavailableError("decode node shut down")
                                                  : s->last_error),
        endings);
  }
}

// Cancellations and deadlines of sequences in flight (under the lock).
void DecodeEngine::ExpireInFlight(std::vector<Ending>* endings) {
  const auto now = clock_.Now();
  for (auto& s : prefilling_) {
    if ((s->sink->cancelled() || now > s->job.deadline || stopping_) && s->transfer) {
      s->transfer->Cancel();
    }
  }
  for (auto it = running_.begin(); it != running_.end();) {
    auto& s = *it;
    if (s->sink->cancelled() || now > s->job.deadline || stopping_) {
      std::shared_ptr<Seq> ending = std::move(*it);
      it = running_.erase(it);
      Complete(ending,
               ending->sink->cancelled() ? absl::CancelledError("cancelled by the client")
               : stopping_               ? absl::UnavailableError("decode node shut down")
                                         : absl::DeadlineExceededError("deadline passed"),
               endings);
    } else {
      ++it;
    }
  }
}

void DecodeEngine::Loop() {
  std::vector<Ending> endings;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle: wait for work, waking now and then for queue timeouts and deadlines.
      if (running_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return wake_.load(); });
      }
      wake_.store(false);
      if (stopping_ && waiting_.empty() && prefilling_.empty() && running_.empty() &&
          prefill_done_.empty()) {
        break;
      }
      HandlePrefillsDone(&endings);
      StartDueRetries(&endings);
      ExpireInFlight(&endings);
      if (!draining_) Admit(&endings);
      finishing_ += static_cast<int>(endings.size());
      if (options_.telemetry) {
        options_.telemetry->SetQueued(static_cast<double>(waiting_.size()));
        options_.telemetry->SetActive(static_cast<double>(prefilling_.size() + running_.size()));
      }
    }
    ReleaseQuarantine();
    Finish(&endings);
    // Decode one token for the batch, without the lock; the sequences it ended leave the
    // batch before their clients hear the end.
    auto ended = Step();
    if (!ended.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [s, st] : ended) {
        std::erase(running_, s);
        Complete(s, st, &endings);
      }
      finishing_ += static_cast<int>(endings.size());
    }
    Finish(&endings);
    if (options_.telemetry) {
      options_.telemetry->SetPool(static_cast<double>(pool_->used()),
                                  static_cast<double>(pool_->capacity()));
    }
  }
}

}  // namespace kvwire
