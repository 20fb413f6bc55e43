#include "decode_service/decode_engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/engine/generate.h"
#include "common/wire/kv_wire.h"
#include "common/base/status.h"
#include "decode_service/stop_matcher.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

// A KV stream the assembler rejects is the prefill node's fault, not the client's request:
// the client must not hear INVALID_ARGUMENT for it.
absl::Status StreamFault(const absl::Status& st) {
  if (st.code() != absl::StatusCode::kInvalidArgument) return st;
  return absl::InternalError(absl::StrCat("from the prefill node: ", st.message()));
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

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

}  // namespace

struct DecodeEngine::Seq {
  enum class State { kWaiting, kPrefilling, kRunning, kDone };

  GenerationJob job;
  std::shared_ptr<ResponseSink> sink;
  State state = State::kWaiting;
  Span span, queue_span, prefill_span, transfer_span, generate_span;

  // Set at admission.
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<DecodeSelector> selector;
  std::vector<int> kept_per_layer;

  // Prefill: touched by the gRPC thread of the current call until it is done.
  std::unique_ptr<KvAssembler> assembler;
  std::shared_ptr<PrefillCall> call;
  bool prefill_inflight = false;
  bool local = false;        // prefilled on this node
  size_t reserve_bytes = 0;  // KV pool bytes the request needs (cache + page summaries)
  int attempts = 0;
  Clock::time_point admitted, first_kv, trailer_at;
  WireTrailer trailer;
  int64_t wire_bytes = 0;
  bool header_seen = false;

  // Generation state: the first token is emitted by whoever completes the prefill, then
  // only by the engine thread.
  std::unique_ptr<SamplingRng> rng;
  std::unique_ptr<StreamingDecoder> decoder;
  std::unique_ptr<StopMatcher> stop;
  std::vector<int32_t> generated;
  bool finished = false;
  Finish finish = Finish::kLength;
  Clock::time_point first_token_at, last_token_at;
  double itl_sum_ms = 0;
  int itl_count = 0;
};

DecodeEngine::DecodeEngine(LlamaModel* model, KvPool* pool, PrefillClient* prefill,
                           DecodeEngineOptions options)
    : model_(model), pool_(pool), prefill_(prefill), options_(std::move(options)) {
  loop_ = std::thread([this] { Loop(); });
  local_ = std::thread([this] { LocalPrefillLoop(); });
}

DecodeEngine::~DecodeEngine() {
  Drain(std::chrono::milliseconds(0));
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  local_cv_.notify_all();
  loop_.join();
  local_.join();
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
  if (options_.telemetry) {
    s->span = options_.telemetry->StartSpan("decode.request", s->job.trace);
    s->span.SetAttribute("request_id", s->job.request_id);
    s->queue_span = options_.telemetry->StartSpan("decode.queue", s->span.context());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) return absl::UnavailableError("decode node is shutting down");
    if (static_cast<int>(waiting_.size()) >= options_.max_queue) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "decode node ", options_.node_name, " is full: ", waiting_.size(),
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
  const auto until = Clock::now() + grace;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, until, [&] { return prefilling_.empty() && running_.empty(); });
}

// Tokenizes and checks what needs the model, sizes the cache and reserves it.
absl::Status DecodeEngine::Prepare(Seq& s) {
  const ModelConfig& mc = model_->config();
  GenerationJob& j = s.job;
  if (j.prompt_ids.empty()) {
    ASSIGN_OR_RETURN(j.prompt_ids, model_->tokenizer().Encode(j.prompt_text));
    if (j.prompt_ids.empty()) return absl::InvalidArgumentError("prompt: encodes to no tokens");
  }
  const int len = static_cast<int>(j.prompt_ids.size());
  RETURN_IF_ERROR(ResolveTwoStage(&j.compression, &j.attention, len, j.max_tokens, mc.head_dim));
  if (len + j.max_tokens > mc.context_limit()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt (", len, " tokens) + max_tokens (", j.max_tokens,
        ") exceeds the model's context of ", mc.context_limit()));
  }
  const KvCacheShape shape =
      CompressedCacheShape(j.compression, mc, model_->kv_dtype(), len, j.max_tokens);
  ASSIGN_OR_RETURN(const size_t selector_bytes, DecodeSelectorBytes(j.attention, mc, shape));
  s.reserve_bytes = KvCache::BytesFor(shape) + selector_bytes;
  if (!pool_->CanEverFit(s.reserve_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", s.reserve_bytes, " bytes of KV cache but the pool holds ",
        pool_->capacity(), " (--kv-pool-bytes); lower max_tokens or the compression budget"));
  }
  // Everything is allocated before anything is kept, so a request that must wait holds no
  // memory while it waits.
  ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(shape, *pool_));
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeSelector> selector,
                   MakeDecodeSelector(j.attention, mc, shape, *pool_));
  s.cache = std::move(cache);
  s.selector = std::move(selector);
  s.cache->set_prompt_len(len);
  s.kept_per_layer.clear();
  for (int l = 0; l < mc.num_layers; ++l) s.kept_per_layer.push_back(j.compression.KeptTokens(l, len));
  s.rng = std::make_unique<SamplingRng>(j.seed);
  s.decoder = std::make_unique<StreamingDecoder>(model_->tokenizer());
  RETURN_IF_ERROR(s.decoder->Prime(j.prompt_ids));
  s.stop = std::make_unique<StopMatcher>(j.stop);
  return absl::OkStatus();
}

void DecodeEngine::Admit(std::vector<std::shared_ptr<Seq>>* finished) {
  // Requests that were cancelled or ran out of time while waiting leave the queue now, not
  // when they reach its head, so they do not hold queue slots.
  const auto now = std::chrono::system_clock::now();
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const bool cancelled = (*it)->sink->cancelled();
    if (!cancelled && now <= (*it)->job.deadline) {
      ++it;
      continue;
    }
    (*it)->sink->Finish(cancelled ? absl::CancelledError("cancelled while queued")
                                  : absl::DeadlineExceededError("deadline passed while queued"),
                        nullptr);
    finished->push_back(*it);
    it = waiting_.erase(it);
  }
  // FIFO: the head waits for room rather than letting later, smaller requests starve it.
  while (!waiting_.empty()) {
    std::shared_ptr<Seq> s = waiting_.front();
    if (static_cast<int>(prefilling_.size() + running_.size()) >= options_.max_batch) return;
    absl::Status st = Prepare(*s);
    if (st.code() == absl::StatusCode::kResourceExhausted && pool_->CanEverFit(s->reserve_bytes)) {
      if (Ms(Clock::now() - s->job.arrival) <= options_.queue_timeout_ms) return;  // wait
      st = absl::ResourceExhaustedError(absl::StrCat(
          "waited ", options_.queue_timeout_ms, " ms for ", s->reserve_bytes,
          " bytes of KV pool; ", pool_->used(), " of ", pool_->capacity(), " are in use"));
    }
    waiting_.pop_front();
    if (!st.ok()) {
      finished->push_back(s);
      s->sink->Finish(st, nullptr);
      continue;
    }
    s->queue_span.End();
    s->admitted = Clock::now();
    s->state = Seq::State::kPrefilling;
    prefilling_.push_back(s);
    s->local = prefill_ == nullptr ||
               static_cast<int>(s->job.prompt_ids.size()) < options_.local_prefill_below;
    if (s->local) {
      local_queue_.push_back(s);
      local_cv_.notify_one();
    } else {
      StartRemotePrefill(s);
    }
  }
}

void DecodeEngine::StartRemotePrefill(const std::shared_ptr<Seq>& s) {
  const ModelConfig& mc = model_->config();
  ++s->attempts;
  s->header_seen = false;
  for (int l = 0; l < s->cache->num_layers(); ++l) s->cache->layer(l).len = 0;
  WireExpectation expect;
  expect.model_fingerprint = model_->fingerprint();
  expect.num_layers = mc.num_layers;
  expect.num_cache_heads = s->cache->shape().n_heads;
  expect.head_dim = mc.head_dim;
  expect.dtype = model_->kv_dtype();
  expect.prompt_len = static_cast<int>(s->job.prompt_ids.size());
  expect.kept_per_layer = s->kept_per_layer;
  expect.max_chunk_bytes = options_.max_chunk_bytes;
  s->assembler = std::make_unique<KvAssembler>(expect, s->cache.get());

  v1::PrefillRequest req;
  req.set_request_id(s->job.request_id);
  for (int32_t id : s->job.prompt_ids) req.add_prompt_ids(id);
  *req.mutable_compression() = ToProto(s->job.compression);
  req.set_model_fingerprint(model_->fingerprint());
  req.set_max_chunk_bytes(static_cast<uint32_t>(options_.max_chunk_bytes));
  req.set_temperature(s->job.sampling.temperature);
  req.set_top_p(s->job.sampling.top_p);
  req.set_top_k(s->job.sampling.top_k);
  req.set_seed(s->job.seed);

  if (options_.telemetry) {
    s->prefill_span = options_.telemetry->StartSpan("decode.prefill_rpc", s->span.context());
    s->prefill_span.SetAttribute("attempt", s->attempts);
  }
  std::weak_ptr<Seq> weak = s;
  PrefillCallbacks cb;
  Seq* raw = s.get();  // valid while the call runs: the engine keeps `s` until on_done
  Telemetry* telemetry = options_.telemetry;
  cb.on_header = [raw, telemetry](const WireHeader& h) {
    raw->first_kv = Clock::now();
    raw->header_seen = true;
    if (telemetry) {
      raw->transfer_span = telemetry->StartSpan("decode.kv_transfer", raw->prefill_span.context());
      raw->transfer_span.SetAttribute("policy", h.policy);
      raw->transfer_span.SetAttribute("kv.kept_tokens",
                                      h.kept_per_layer.empty() ? 0 : h.kept_per_layer.back());
    }
    return StreamFault(raw->assembler->OnHeader(h));
  };
  cb.on_chunk = [raw](const WireChunk& c) { return StreamFault(raw->assembler->OnChunk(c)); };
  cb.on_trailer = [this, raw](const WireTrailer& t) {
    RETURN_IF_ERROR(StreamFault(raw->assembler->OnTrailer(t, model_->config().vocab_size)));
    raw->trailer = t;
    raw->trailer_at = Clock::now();
    // The first token goes to the client now, not at the next decode step. Its random
    // draw was the prefill node's; this keeps the local generator in step.
    raw->rng->Uniform();
    Emit(*raw, t.first_token, t.first_logprob);
    return absl::OkStatus();
  };
  cb.on_done = [this, weak](const absl::Status& st, int64_t wire_bytes) {
    std::shared_ptr<Seq> seq = weak.lock();
    if (!seq) return;
    seq->wire_bytes += wire_bytes;
    // The transfer: first KV byte to the end of the stream, with what it carried.
    seq->transfer_span.SetAttribute("kv.wire_bytes", wire_bytes);
    seq->transfer_span.SetAttribute("kv.full_bytes", seq->trailer.full_cache_bytes);
    seq->transfer_span.SetAttribute("kv.chunks", seq->trailer.chunks);
    seq->transfer_span.SetError(seq->assembler->complete() ? absl::OkStatus() : st);
    seq->transfer_span.End();
    OnPrefillDone(std::move(seq), st);  // this thread keeps no reference past the hand-over
  };
  s->prefill_inflight = true;
  TraceContext ctx = s->prefill_span.context().valid() ? s->prefill_span.context() : s->job.trace;
  s->call = prefill_->Start(req, s->job.deadline, ctx, std::move(cb));
}

void DecodeEngine::OnPrefillDone(std::shared_ptr<Seq> s, absl::Status status) {
  // A complete stream counts even if the call then failed: the cache is whole.
  if (s->assembler && s->assembler->complete()) status = absl::OkStatus();
  // Notified under the lock: once it is released the engine may finish and be destroyed,
  // and this (gRPC) thread must not touch it after that.
  std::lock_guard<std::mutex> lock(mu_);
  prefill_done_.emplace_back(std::move(s), status);
  wake_ = true;
  cv_.notify_all();
}

void DecodeEngine::LocalPrefillLoop() {
  for (;;) {
    std::shared_ptr<Seq> s;
    {
      std::unique_lock<std::mutex> lock(mu_);
      local_cv_.wait(lock, [&] { return stopping_ || !local_queue_.empty(); });
      if (stopping_ && local_queue_.empty()) return;
      s = std::move(local_queue_.front());
      local_queue_.pop_front();
      s->prefill_inflight = true;
    }
    RunLocalPrefill(s);
  }
}

// A prefill on this node's own model, for short prompts (or no prefill nodes).
void DecodeEngine::RunLocalPrefill(const std::shared_ptr<Seq>& s) {
  class Guard : public PrefillObserver {
   public:
    Guard(PrefillObserver* inner, Seq* s) : inner_(inner), s_(s) {}
    int window(int len) const override { return inner_->window(len); }
    absl::Status OnLayer(const PrefillLayer& l) override {
      if (s_->sink->cancelled()) return absl::CancelledError("cancelled by the client");
      if (std::chrono::system_clock::now() > s_->job.deadline) {
        return absl::DeadlineExceededError("deadline passed during prefill");
      }
      return inner_->OnLayer(l);
    }

   private:
    PrefillObserver* inner_;
    Seq* s_;
  };
  ++s->attempts;
  const auto t0 = Clock::now();
  s->first_kv = t0;
  CacheSink sink(s->cache.get());
  Compressor compressor(s->job.compression, model_->config(), model_->kv_dtype(), &sink);
  Guard guard(&compressor, s.get());
  auto result = model_->Prefill(s->job.prompt_ids, &guard);
  absl::Status st = result.status();
  if (st.ok()) {
    s->trailer.forward_ms = Ms(Clock::now() - t0);
    s->trailer.compress_ms = compressor.seconds() * 1e3;
    s->trailer.node = "local";
    s->trailer.full_cache_bytes =
        int64_t{static_cast<int>(s->job.prompt_ids.size())} *
        model_->config().KvBytesPerToken(model_->kv_dtype());
    s->trailer_at = Clock::now();
    const kernels::SampledToken tok = kernels::Sample(
        result->logits.data(), model_->config().vocab_size, s->job.sampling, s->rng->Uniform());
    s->trailer.first_token = tok.id;
    Emit(*s, tok.id, tok.logprob);
  }
  OnPrefillDone(s, st);
}

bool DecodeEngine::Emit(Seq& s, int32_t token, float logprob) {
  const auto now = Clock::now();
  if (s.generated.empty()) {
    s.first_token_at = now;
  } else {
    const double itl = Ms(now - s.last_token_at);
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
    s.finish = Finish::kStop;
  } else if (static_cast<int>(s.generated.size()) >= s.job.max_tokens) {
    s.finished = true;
    s.finish = Finish::kLength;
  }
  if (s.finished && !s.stop->stopped()) delta.text += s.stop->Push(s.decoder->Flush()) + s.stop->Flush();
  s.sink->Send(std::move(delta));
  return s.finished;
}

void DecodeEngine::Complete(const std::shared_ptr<Seq>& s, const absl::Status& status) {
  s->state = Seq::State::kDone;
  const ModelConfig& mc = model_->config();
  RequestFigures f;
  f.prompt_tokens = static_cast<int>(s->job.prompt_ids.size());
  f.completion_tokens = static_cast<int>(s->generated.size());
  f.kept_tokens = s->job.compression.KeptTokens(s->job.compression.skip_layers, f.prompt_tokens);
  f.full_cache_bytes = int64_t{f.prompt_tokens} * mc.KvBytesPerToken(model_->kv_dtype());
  f.wire_bytes = s->wire_bytes;
  f.transfer_ms = s->local ? 0 : Ms(s->trailer_at - s->first_kv);
  f.prefill_ms = s->trailer.forward_ms;
  f.queue_ms = Ms(s->admitted - s->job.arrival);
  f.ttft_ms = Ms(s->first_token_at - s->job.arrival);
  f.mean_itl_ms = s->itl_count ? s->itl_sum_ms / s->itl_count : 0;
  f.policy = s->job.compression.Describe();
  f.prefill_node = s->trailer.node;
  f.decode_node = options_.node_name;
  f.attention = s->job.attention.Describe();
  f.prefill_attempts = s->attempts;
  f.finish = s->finish;
  if (Telemetry* t = options_.telemetry) {
    t->CountRequest(status);
    t->ObserveRequest(Ms(Clock::now() - s->job.arrival) / 1e3);
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
  s->sink->Finish(status, status.ok() ? &f : nullptr);
}

void DecodeEngine::Step(std::vector<std::shared_ptr<Seq>>* finished) {
  // The batch: every running sequence, oldest first, up to max_batch.
  std::vector<std::shared_ptr<Seq>> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : running_) {
      if (static_cast<int>(batch.size()) >= options_.max_batch) break;
      batch.push_back(s);
    }
  }
  if (batch.empty()) return;
  const int vocab = model_->config().vocab_size;
  std::vector<DecodeInput> inputs;
  for (auto& s : batch) {
    DecodeInput in;
    in.token = s->generated.back();
    in.position = s->cache->prompt_len() + static_cast<int>(s->generated.size()) - 1;
    in.cache = s->cache.get();
    in.selector = s->selector.get();
    inputs.push_back(in);
  }
  std::vector<float> logits(batch.size() * static_cast<size_t>(vocab));
  const absl::Status st = model_->DecodeStep(inputs, logits.data());
  for (size_t b = 0; b < batch.size(); ++b) {
    Seq& s = *batch[b];
    if (!st.ok()) {
      s.finished = true;
      finished->push_back(batch[b]);
      Complete(batch[b], st);
      continue;
    }
    const kernels::SampledToken tok =
        kernels::Sample(logits.data() + b * vocab, vocab, s.job.sampling, s.rng->Uniform());
    if (Emit(s, tok.id, tok.logprob)) {
      finished->push_back(batch[b]);
      Complete(batch[b], absl::OkStatus());
    }
  }
}

void DecodeEngine::Loop() {
  for (;;) {
    std::vector<std::shared_ptr<Seq>> finished;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle: wait for work, waking now and then for queue timeouts and deadlines.
      if (running_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stopping_ || wake_.load(); });
      }
      wake_.store(false);
      if (stopping_ && waiting_.empty() && prefilling_.empty() && running_.empty()) break;

      // Prefills that ended: join the batch, retry elsewhere, or fail.
      auto done = std::move(prefill_done_);
      prefill_done_.clear();
      for (auto& [s, st] : done) {
        s->prefill_inflight = false;
        s->call.reset();
        s->prefill_span.SetError(st);
        s->prefill_span.End();
        if (st.ok() && options_.telemetry) {
          options_.telemetry->CountTransfer(s->local ? "local" : "grpc",
                                            std::string(PolicyName(s->job.compression.policy)),
                                            s->trailer.full_cache_bytes, s->wire_bytes);
          if (!s->local) options_.telemetry->ObserveTransfer(Ms(s->trailer_at - s->first_kv) / 1e3);
        }
        if (st.ok() && s->finished) {  // the first token already ended it
          std::erase(prefilling_, s);
          finished.push_back(s);
          Complete(s, absl::OkStatus());
        } else if (st.ok()) {
          std::erase(prefilling_, s);
          s->state = Seq::State::kRunning;
          running_.push_back(s);
          if (options_.telemetry) {
            s->generate_span = options_.telemetry->StartSpan("decode.generate", s->span.context());
            s->generate_span.SetAttribute("attention", s->job.attention.Describe());
          }
        } else if (Retryable(st) && !s->sink->cancelled() && !draining_ &&
                   s->attempts < options_.prefill_attempts && !s->local &&
                   std::chrono::system_clock::now() < s->job.deadline) {
          if (options_.telemetry) options_.telemetry->CountTransferFailure(StatusLabel(st));
          StartRemotePrefill(s);
        } else {
          if (options_.telemetry && !s->local) {
            options_.telemetry->CountTransferFailure(StatusLabel(st));
          }
          std::erase(prefilling_, s);
          finished.push_back(s);
          absl::Status final = st;
          if (s->sink->cancelled()) {
            final = absl::CancelledError("cancelled by the client");
          } else if (std::chrono::system_clock::now() > s->job.deadline) {
            final = absl::DeadlineExceededError("deadline passed during prefill");
          }
          Complete(s, Annotate(final, absl::StrCat("prefill (", s->attempts, " attempt",
                                                   s->attempts == 1 ? "" : "s", ")")));
        }
      }
      // Cancellations and deadlines of sequences in flight.
      const auto now = std::chrono::system_clock::now();
      for (auto& s : prefilling_) {
        if ((s->sink->cancelled() || now > s->job.deadline || stopping_) && s->call) {
          s->call->Cancel();
        }
      }
      for (auto it = running_.begin(); it != running_.end();) {
        auto& s = *it;
        if (s->sink->cancelled() || now > s->job.deadline || stopping_) {
          finished.push_back(s);
          Complete(s, s->sink->cancelled() ? absl::CancelledError("cancelled by the client")
                       : stopping_         ? absl::UnavailableError("decode node shut down")
                                           : absl::DeadlineExceededError("deadline passed"));
          it = running_.erase(it);
        } else {
          ++it;
        }
      }
      if (!draining_) Admit(&finished);
      if (options_.telemetry) {
        options_.telemetry->SetQueued(static_cast<double>(waiting_.size()));
        options_.telemetry->SetActive(static_cast<double>(prefilling_.size() + running_.size()));
      }
    }
    // Decode one token for the batch, without the lock.
    std::vector<std::shared_ptr<Seq>> stepped;
    Step(&stepped);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& s : stepped) std::erase(running_, s);
      cv_.notify_all();  // Drain waits for the batch to empty
    }
    finished.insert(finished.end(), stepped.begin(), stepped.end());
    // Caches go back to the pool here, outside the lock (the pool wakes the engine).
    for (auto& s : finished) s->cache.reset();
    finished.clear();
    if (options_.telemetry) {
      options_.telemetry->SetPool(static_cast<double>(pool_->used()),
                                  static_cast<double>(pool_->capacity()));
    }
  }
}

}  // namespace kvwire
