#include "common/engine/prefill_engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

// Cuts each compressed layer into bounded chunks for the stream.
class ChunkingSink final : public CompressedLayerSink {
 public:
  ChunkingSink(KvStreamSink* out, KvFormat format, size_t max_chunk_bytes)
      : out_(out), format_(format), max_chunk_bytes_(max_chunk_bytes) {}

  absl::Status Accept(CompressedLayer layer) override {
    for (WireChunk& chunk : ChunkLayer(layer, format_, max_chunk_bytes_)) {
      payload_bytes_ += static_cast<int64_t>(chunk.payload_bytes());
      RETURN_IF_ERROR(out_->OnChunk(std::move(chunk)));
      ++chunks_;
    }
    return absl::OkStatus();
  }
  int chunks() const { return chunks_; }
  int64_t payload_bytes() const { return payload_bytes_; }

 private:
  KvStreamSink* out_;
  KvFormat format_;
  size_t max_chunk_bytes_;
  int chunks_ = 0;
  int64_t payload_bytes_ = 0;
};

// Stops the forward pass between layers when the reader is gone or the deadline passed,
// traces each layer's compression (cheap next to the layer's forward pass), and, with a prefix
// cache, copies the layer's rows of the blocks this prefill fills into it once the compressor
// saw them.
class Guarded final : public PrefillObserver {
 public:
  Guarded(Compressor* inner, const KvStreamSink* sink, const PrefillJob& job, const Clock& clock,
          Telemetry* telemetry, const Span* forward, PrefixCache* cache,
          const PrefixCache::Plan* plan)
      : inner_(inner),
        sink_(sink),
        job_(job),
        clock_(clock),
        telemetry_(telemetry),
        forward_(forward),
        cache_(cache),
        plan_(plan) {}
  int window(int len) const override { return inner_->window(len); }
  bool NeedsScores(int layer, int len) const override { return inner_->NeedsScores(layer, len); }
  absl::Status Finish() override { return inner_->Finish(); }
  absl::Status OnLayer(const PrefillLayer& layer) override {
    if (sink_->cancelled()) return absl::CancelledError("prefill cancelled by its reader");
    if (clock_.Now() > job_.deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("deadline passed during prefill, at layer ", layer.layer));
    }
    RETURN_IF_ERROR(Compress(layer));
    if (cache_ == nullptr) return absl::OkStatus();
    return cache_->Capture(*plan_, layer.layer, layer.k, layer.v, layer.kv_stride);
  }

 private:
  absl::Status Compress(const PrefillLayer& layer) {
    if (telemetry_ == nullptr) return inner_->OnLayer(layer);
    Span span = telemetry_->StartSpan("prefill.compress", forward_->context());
    span.SetAttribute("layer", layer.layer);
    const absl::Status st = inner_->OnLayer(layer);
    span.SetError(st);
    return st;
  }

  Compressor* inner_;
  const KvStreamSink* sink_;
  const PrefillJob& job_;
  const Clock& clock_;
  Telemetry* telemetry_;
  const Span* forward_;
  PrefixCache* cache_;             // null: none
  const PrefixCache::Plan* plan_;  // the cache's plan for this prefill
};

}  // namespace

struct PrefillEngine::Queued {
  PrefillJob job;
  std::shared_ptr<KvStreamSink> sink;
  Done done;
  Clock::TimePoint received;
};

WireHeader StreamHeader(const LlamaModel& model, const CompressionConfig& config, int len) {
  const ModelConfig& mc = model.config();
  WireHeader h;
  h.model_fingerprint = model.fingerprint();
  h.num_layers = mc.num_layers;
  h.num_cache_heads = config.CacheHeads(mc.num_heads, mc.num_kv_heads);
  h.head_dim = mc.head_dim;
  h.dtype = model.kv_dtype();
  h.kv_format = config.kv_format;
  h.policy = config.Describe();
  h.prompt_len = len;
  for (int l = 0; l < mc.num_layers; ++l) h.kept_per_layer.push_back(config.KeptTokens(l, len));
  return h;
}

WireExpectation StreamExpectation(const LlamaModel& model, const CompressionConfig& config, int len,
                                  size_t max_chunk_bytes) {
  WireExpectation e = ExpectHeader(StreamHeader(model, config, len));
  e.max_chunk_bytes = max_chunk_bytes;
  return e;
}

PrefillEngine::PrefillEngine(LlamaModel* model, PrefillEngineOptions options)
    : model_(model), options_(std::move(options)) {
  KVWIRE_CHECK(options_.workers >= 0 && options_.max_queue >= 1 && options_.clock != nullptr &&
               options_.prefix_block_tokens >= 1);
  if (options_.prefix_cache_bytes > 0) {
    const ModelConfig& mc = model_->config();
    prefix_cache_ = std::make_unique<PrefixCache>(
        model_->backend(), mc.num_layers, mc.num_kv_heads * mc.head_dim,
        options_.prefix_block_tokens, options_.prefix_cache_bytes, model_->fingerprint());
  }
  for (int i = 0; i < options_.workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

PrefillEngine::~PrefillEngine() { Shutdown(); }

absl::Status PrefillEngine::Check(const PrefillJob& job) const {
  const ModelConfig& mc = model_->config();
  if (job.model_fingerprint && *job.model_fingerprint != model_->fingerprint()) {
    // Neither fingerprint is named: a caller is not told what this node would accept.
    return absl::FailedPreconditionError(
        absl::StrCat("request is for another model than node ", options_.node_name,
                     " serves (the model fingerprints differ: load the same model on both nodes)"));
  }
  const int len = static_cast<int>(job.prompt_ids.size());
  // Each refusal names its PrefillRequest field (FieldOf), for google.rpc.BadRequest.
  if (len == 0) return AboutField(absl::InvalidArgumentError("prompt_ids is empty"), "prompt_ids");
  if (len > mc.context_limit()) {
    return AboutField(
        absl::InvalidArgumentError(absl::StrCat(
            "prompt of ", len, " tokens exceeds the model's context of ", mc.context_limit())),
        "prompt_ids");
  }
  for (int i = 0; i < len; ++i) {
    if (job.prompt_ids[i] < 0 || job.prompt_ids[i] >= mc.vocab_size) {
      return AboutField(absl::InvalidArgumentError(
                            absl::StrCat("prompt_ids[", i, "] = ", job.prompt_ids[i],
                                         " is outside the vocabulary [0, ", mc.vocab_size, ")")),
                        absl::StrCat("prompt_ids[", i, "]"));
    }
  }
  const auto as_field = [](absl::string_view n) { return absl::StrCat("compression.", n); };
  RETURN_IF_ERROR(RenameParams(job.compression.Validate(), as_field));
  RETURN_IF_ERROR(RenameParams(job.compression.ValidateFor(mc.num_layers, mc.head_dim), as_field));
  if (!job.compression.policy->selects()) {
    return AboutField(absl::InvalidArgumentError(
                          absl::StrCat("compression.policy: ", job.compression.policy_name(),
                                       " must be resolved into its two stages by the decode node")),
                      "compression.policy");
  }
  if (job.max_chunk_bytes < 1024 || job.max_chunk_bytes > kMaxChunkBytesLimit) {
    return AboutField(absl::InvalidArgumentError(absl::StrCat("max_chunk_bytes must be in [1024, ",
                                                              kMaxChunkBytesLimit, "], got ",
                                                              job.max_chunk_bytes)),
                      "max_chunk_bytes");
  }
  const kernels::SamplingParams& s = job.sampling;
  // The decode node's bounds (decode_service/translate.cc): a direct caller gets no more.
  const auto bad = [](absl::string_view field, absl::string_view what, double got) {
    return AboutField(
        absl::InvalidArgumentError(absl::StrCat(field, " must be ", what, ", got ", got)), field);
  };
  if (!(s.temperature >= 0 && s.temperature <= 100)) {
    return bad("temperature", "in [0, 100]", s.temperature);
  }
  if (!(s.top_p > 0 && s.top_p <= 1)) return bad("top_p", "in (0, 1]", s.top_p);
  if (s.top_k < 0) return bad("top_k", ">= 0", s.top_k);
  return absl::OkStatus();
}

absl::StatusOr<PrefillOutcome> PrefillEngine::Run(const PrefillJob& job, KvStreamSink& sink) {
  const ModelConfig& mc = model_->config();
  Telemetry* telemetry = options_.telemetry;
  const Clock& clock = *options_.clock;
  Span span = telemetry ? telemetry->StartSpan("prefill.serve", job.trace) : Span();
  span.SetAttribute("request_id", job.request_id);
  if (sink.cancelled()) return absl::CancelledError("cancelled while queued");
  if (clock.Now() > job.deadline) {
    return absl::DeadlineExceededError("deadline passed while queued for prefill");
  }
  RETURN_IF_ERROR(Check(job));
  const int len = static_cast<int>(job.prompt_ids.size());
  const CompressionConfig& config = job.compression;

  const WireHeader header = StreamHeader(*model_, config, len);
  RETURN_IF_ERROR(sink.OnHeader(header));
  const auto t0 = clock.Now();
  ChunkingSink chunks(&sink, config.kv_format, job.max_chunk_bytes);
  Compressor compressor(config, mc, model_->kv_dtype(), &chunks);
  Span forward = telemetry ? telemetry->StartSpan("prefill.forward", span.context()) : Span();
  // With a prefix cache: the cached blocks that start the prompt, up to where the compressor's
  // observation window begins (its queries are computed anew, so it scores every key as a cold
  // prefill does), and the prompt's other whole blocks filled for the next request.
  PrefixCache::Plan plan;
  if (prefix_cache_ != nullptr) {
    plan = prefix_cache_->Lookup(job.prompt_ids, len - std::max(1, compressor.window(len)));
  }
  Guarded observer(&compressor, &sink, job, clock, telemetry, &forward, prefix_cache_.get(), &plan);
  auto result = model_->Prefill(job.prompt_ids, &observer, /*all_logits=*/false,
                                plan.hit_tokens() > 0 ? &plan.prefix : nullptr);
  forward.SetAttribute("prompt_tokens", len);
  const int cached = plan.hit_tokens();
  if (prefix_cache_ != nullptr) {
    prefix_cache_->Finish(plan, result.ok());
    forward.SetAttribute("prefix.hit_tokens", cached);
    if (telemetry) {
      const PrefixCache::Counters c = prefix_cache_->counters();
      telemetry->CountPrefix(cached, len - cached, static_cast<double>(c.bytes), c.evictions);
    }
  }
  forward.End();
  RETURN_IF_ERROR(result.status());

  PrefillOutcome out;
  out.logits = std::move(result->logits);
  SamplingRng rng(job.seed);
  const kernels::SampledToken tok =
      kernels::Sample(out.logits.data(), mc.vocab_size, job.sampling, rng.Uniform());
  WireTrailer& trailer = out.trailer;
  trailer.first_token = tok.id;
  trailer.first_logprob = tok.logprob;
  trailer.forward_ms = Milliseconds(clock.Now() - t0);
  trailer.compress_ms = compressor.seconds() * 1e3;
  trailer.full_cache_bytes = int64_t{len} * mc.KvBytesPerToken(model_->kv_dtype());
  trailer.kv_payload_bytes = chunks.payload_bytes();
  trailer.chunks = chunks.chunks();
  trailer.node = options_.node_name;
  trailer.cached_tokens = cached;
  RETURN_IF_ERROR(sink.OnTrailer(trailer));

  span.SetAttribute("policy", header.policy);
  span.SetAttribute("budget", config.EffectiveBudget(len));
  span.SetAttribute("kv.kept_tokens", header.kept_per_layer.back());
  span.SetAttribute("kv.full_bytes", trailer.full_cache_bytes);
  span.SetAttribute("kv.wire_bytes", sink.transport_bytes());
  if (telemetry) {
    telemetry->ObservePrefill(trailer.forward_ms / 1e3, trailer.compress_ms / 1e3);
    telemetry->CountTransfer(std::string(sink.transport()), std::string(config.policy_name()),
                             trailer.full_cache_bytes, sink.transport_bytes());
  }
  return out;
}

absl::Status PrefillEngine::Submit(PrefillJob job, std::shared_ptr<KvStreamSink> sink, Done done) {
  auto q = std::make_unique<Queued>();
  q->job = std::move(job);
  q->sink = std::move(sink);
  q->done = std::move(done);
  q->received = options_.clock->Now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.workers == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "prefill engine ", options_.node_name, " has no workers: it runs prefills with Run"));
    }
    if (stopping_) {
      return absl::UnavailableError(
          absl::StrCat("prefill node ", options_.node_name, " is shutting down"));
    }
    if (static_cast<int>(queue_.size()) >= options_.max_queue) {
      const absl::Status full = absl::ResourceExhaustedError(
          absl::StrCat("prefill node ", options_.node_name, " is full: ", queue_.size(),
                       " prefills queued (--max-queue ", options_.max_queue, ")"));
      if (options_.telemetry) options_.telemetry->CountRequest(full);
      return full;
    }
    queue_.push_back(std::move(q));
    if (options_.telemetry) options_.telemetry->SetQueued(static_cast<double>(queue_.size()));
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void PrefillEngine::WorkerLoop() {
  for (;;) {
    std::unique_ptr<Queued> q;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      q = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
      if (options_.telemetry) {
        options_.telemetry->SetQueued(static_cast<double>(queue_.size()));
        options_.telemetry->SetActive(running_);
      }
    }
    if (options_.telemetry) {
      options_.telemetry->ObserveQueue(Milliseconds(options_.clock->Now() - q->received) / 1e3);
    }
    const absl::Status st = Run(q->job, *q->sink).status();
    if (options_.telemetry) options_.telemetry->CountRequest(st);
    q->done(st);
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
    if (options_.telemetry) options_.telemetry->SetActive(running_);
  }
}

void PrefillEngine::Shutdown() {
  std::deque<std::unique_ptr<Queued>> refused;
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    refused.swap(queue_);
    workers.swap(workers_);  // a second Shutdown finds none to join
  }
  cv_.notify_all();
  for (auto& q : refused) {
    q->done(
        absl::UnavailableError(absl::StrCat("prefill node ", options_.node_name, " shut down")));
  }
  for (auto& t : workers) t.join();
}

}  // namespace kvwire
