#include "prefill_service/prefill_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/compression/compression.h"
#include "common/engine/generate.h"
#include "common/server/grpc_stream.h"
#include "common/wire/kv_wire.h"
#include "common/base/status.h"
#include "common/telemetry/telemetry.h"
#include "kvwire/v1/prefill.grpc.pb.h"
#include "proto/convert.h"

namespace kvwire {
namespace {

using Clock = std::chrono::steady_clock;
using Stream = StreamState<v1::PrefillResponse>;

// Chunks queued ahead of the network per stream: enough to keep it busy while the next
// layer computes, few enough that a slow reader does not make the node buffer the cache.
constexpr size_t kMaxQueuedChunks = 8;

struct Job {
  v1::PrefillRequest request;
  std::shared_ptr<Stream> stream;
  std::chrono::system_clock::time_point deadline;
  Clock::time_point received = Clock::now();
  TraceContext trace;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Sends each compressed layer as it is produced: chunks, with backpressure.
class WireSink : public CompressedLayerSink {
 public:
  WireSink(Stream* stream, size_t max_chunk_bytes, const PrefillServerOptions& options)
      : stream_(stream), max_chunk_bytes_(max_chunk_bytes), options_(options) {}

  absl::Status Accept(CompressedLayer layer) override {
    for (WireChunk& chunk : ChunkLayer(layer, max_chunk_bytes_)) {
      if (options_.testing_before_chunk) options_.testing_before_chunk(chunks_);
      if (chunks_ == options_.testing_corrupt_chunk && !chunk.k.empty()) chunk.k[0] ^= 0x5a;
      payload_bytes_ += static_cast<int64_t>(chunk.payload_bytes());
      v1::PrefillResponse msg;
      ToProto(std::move(chunk), msg.mutable_chunk());
      wire_bytes_ += static_cast<int64_t>(msg.ByteSizeLong());
      if (!stream_->WaitForRoom(kMaxQueuedChunks) || !stream_->Send(std::move(msg))) {
        return absl::CancelledError("the decode node went away");
      }
      ++chunks_;
    }
    return absl::OkStatus();
  }
  int chunks() const { return chunks_; }
  int64_t payload_bytes() const { return payload_bytes_; }
  int64_t wire_bytes() const { return wire_bytes_; }

 private:
  Stream* stream_;
  size_t max_chunk_bytes_;
  const PrefillServerOptions& options_;
  int chunks_ = 0;
  int64_t payload_bytes_ = 0, wire_bytes_ = 0;
};

// A span per layer for the compression step (cheap next to the layer's forward pass).
class TracedCompressor : public PrefillObserver {
 public:
  TracedCompressor(Compressor* inner, Telemetry* telemetry, const Span* parent)
      : inner_(inner), telemetry_(telemetry), parent_(parent) {}
  int window(int len) const override { return inner_->window(len); }
  absl::Status OnLayer(const PrefillLayer& layer) override {
    if (telemetry_ == nullptr) return inner_->OnLayer(layer);
    Span span = telemetry_->StartSpan("prefill.compress", parent_->context());
    span.SetAttribute("layer", layer.layer);
    const absl::Status st = inner_->OnLayer(layer);
    span.SetError(st);
    return st;
  }

 private:
  Compressor* inner_;
  Telemetry* telemetry_;
  const Span* parent_;
};

// Stops the forward pass between layers when the caller is gone or out of time.
class Interruptible : public PrefillObserver {
 public:
  Interruptible(PrefillObserver* inner, Stream* stream,
                std::chrono::system_clock::time_point deadline)
      : inner_(inner), stream_(stream), deadline_(deadline) {}
  int window(int len) const override { return inner_->window(len); }
  absl::Status OnLayer(const PrefillLayer& layer) override {
    if (stream_->cancelled()) return absl::CancelledError("prefill cancelled by the decode node");
    if (std::chrono::system_clock::now() > deadline_) {
      return absl::DeadlineExceededError(
          absl::StrCat("deadline passed during prefill, at layer ", layer.layer));
    }
    return inner_->OnLayer(layer);
  }

 private:
  PrefillObserver* inner_;
  Stream* stream_;
  std::chrono::system_clock::time_point deadline_;
};

}  // namespace

struct PrefillServer::Impl final : public v1::Prefill::CallbackService {
  LlamaModel* model;
  PrefillServerOptions options;
  std::unique_ptr<grpc::Server> server;
  int port = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Job>> queue;
  bool stopping = false;
  int running = 0;
  std::vector<std::thread> workers;

  grpc::ServerWriteReactor<v1::PrefillResponse>* Prefill(
      grpc::CallbackServerContext* ctx, const v1::PrefillRequest* request) override {
    auto job = std::make_unique<Job>();
    job->request = *request;
    job->deadline = ctx->deadline();
    job->trace = TraceFromMetadata(ctx->client_metadata());
    auto [stream, reactor] = Stream::Create([this] { cv.notify_all(); });
    job->stream = stream;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) {
        stream->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "prefill node shutting down"));
        return reactor;
      }
      if (static_cast<int>(queue.size()) >= options.max_queue) {
        if (options.telemetry) options.telemetry->CountRequest(absl::ResourceExhaustedError("queue full"));
        stream->Finish(grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("prefill node ", options.node_name, " is full: ", queue.size(),
                         " prefills queued (--max-queue ", options.max_queue, ")")));
        return reactor;
      }
      queue.push_back(std::move(job));
      if (options.telemetry) options.telemetry->SetQueued(static_cast<double>(queue.size()));
    }
    cv.notify_one();
    return reactor;
  }

  void WorkerLoop() {
    for (;;) {
      std::unique_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (stopping && queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
        ++running;
        if (options.telemetry) {
          options.telemetry->SetQueued(static_cast<double>(queue.size()));
          options.telemetry->SetActive(running);
        }
      }
      const absl::Status st = Run(*job);
      job->stream->Finish(ToGrpcStatus(st));
      if (options.telemetry) options.telemetry->CountRequest(st);
      std::lock_guard<std::mutex> lock(mu);
      --running;
      if (options.telemetry) options.telemetry->SetActive(running);
    }
  }

  absl::Status Run(Job& job) {
    const v1::PrefillRequest& req = job.request;
    const ModelConfig& mc = model->config();
    Span span = options.telemetry ? options.telemetry->StartSpan("prefill.serve", job.trace)
                                  : Span();
    span.SetAttribute("request_id", req.request_id());
    if (options.telemetry) {
      options.telemetry->ObserveQueue(Ms(Clock::now() - job.received) / 1e3);
    }
    if (job.stream->cancelled()) return absl::CancelledError("cancelled while queued");
    if (std::chrono::system_clock::now() > job.deadline) {
      return absl::DeadlineExceededError("deadline passed while queued for prefill");
    }
    if (req.model_fingerprint() != model->fingerprint()) {
      return absl::FailedPreconditionError(
          absl::StrCat("request is for model '", req.model_fingerprint(), "' but node ",
                       options.node_name, " serves '", model->fingerprint(), "'"));
    }
    const int len = req.prompt_ids_size();
    if (len == 0) return absl::InvalidArgumentError("prompt_ids is empty");
    if (len > mc.context_limit()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt of ", len,
                                                     " tokens exceeds the model's context of ",
                                                     mc.context_limit()));
    }
    std::vector<int32_t> ids(req.prompt_ids().begin(), req.prompt_ids().end());
    for (int i = 0; i < len; ++i) {
      if (ids[i] < 0 || ids[i] >= mc.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("prompt_ids[", i, "] = ", ids[i],
                                                       " is outside the vocabulary [0, ",
                                                       mc.vocab_size, ")"));
      }
    }
    CompressionConfig config;
    RETURN_IF_ERROR(ApplyCompressionParams(req.compression(), &config));
    if (config.policy == Policy::kRocketKV) {
      return absl::InvalidArgumentError(
          "compression.policy: rocketkv must be resolved into its two stages by the decode node");
    }
    const size_t max_chunk = req.max_chunk_bytes() == 0
                                 ? kDefaultMaxChunkBytes
                                 : std::min<size_t>(req.max_chunk_bytes(), kMaxChunkBytesLimit);
    if (max_chunk < 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_chunk_bytes must be at least 1024, got ", req.max_chunk_bytes()));
    }
    if (!(req.temperature() >= 0) || !(req.top_p() >= 0 && req.top_p() <= 1) || req.top_k() < 0) {
      return absl::InvalidArgumentError("sampling: need temperature >= 0, top_p in [0, 1], top_k >= 0");
    }

    WireHeader header;
    header.model_fingerprint = model->fingerprint();
    header.num_layers = mc.num_layers;
    header.num_cache_heads = config.CacheHeads(mc.num_heads, mc.num_kv_heads);
    header.head_dim = mc.head_dim;
    header.dtype = model->kv_dtype();
    header.policy = config.Describe();
    header.prompt_len = len;
    for (int l = 0; l < mc.num_layers; ++l) header.kept_per_layer.push_back(config.KeptTokens(l, len));
    v1::PrefillResponse first;
    *first.mutable_header() = ToProto(header);
    const int64_t header_bytes = static_cast<int64_t>(first.ByteSizeLong());
    if (!job.stream->Send(std::move(first))) return absl::CancelledError("the decode node went away");

    const auto t0 = Clock::now();
    WireSink sink(job.stream.get(), max_chunk, options);
    Compressor compressor(config, mc, model->kv_dtype(), &sink);
    Span forward = options.telemetry ? options.telemetry->StartSpan("prefill.forward", span.context())
                                     : Span();
    TracedCompressor traced(&compressor, options.telemetry, &forward);
    Interruptible observer(&traced, job.stream.get(), job.deadline);
    auto result = model->Prefill(ids, &observer);
    forward.SetAttribute("prompt_tokens", len);
    forward.End();
    RETURN_IF_ERROR(result.status());
    const double forward_ms = Ms(Clock::now() - t0);

    kernels::SamplingParams sampling;
    sampling.temperature = req.temperature();
    sampling.top_p = req.top_p() > 0 ? req.top_p() : 1.f;
    sampling.top_k = req.top_k();
    SamplingRng rng(req.seed());
    const kernels::SampledToken tok =
        kernels::Sample(result->logits.data(), mc.vocab_size, sampling, rng.Uniform());

    WireTrailer trailer;
    trailer.first_token = tok.id;
    trailer.first_logprob = tok.logprob;
    trailer.forward_ms = forward_ms;
    trailer.compress_ms = compressor.seconds() * 1e3;
    trailer.full_cache_bytes = int64_t{len} * mc.KvBytesPerToken(model->kv_dtype());
    trailer.kv_payload_bytes = sink.payload_bytes();
    trailer.chunks = sink.chunks();
    trailer.node = options.node_name;
    v1::PrefillResponse last;
    *last.mutable_trailer() = ToProto(trailer);
    // Wire bytes count every message of the stream, as the decode node counts them.
    const int64_t wire_bytes = header_bytes + sink.wire_bytes() + static_cast<int64_t>(last.ByteSizeLong());
    if (!job.stream->Send(std::move(last))) return absl::CancelledError("the decode node went away");
    span.SetAttribute("policy", header.policy);
    span.SetAttribute("budget", config.EffectiveBudget(len));
    span.SetAttribute("kv.kept_tokens", header.kept_per_layer.back());
    span.SetAttribute("kv.full_bytes", trailer.full_cache_bytes);
    span.SetAttribute("kv.wire_bytes", wire_bytes);
    if (options.telemetry) {
      options.telemetry->ObservePrefill(forward_ms / 1e3, trailer.compress_ms / 1e3);
      options.telemetry->CountTransfer("grpc", std::string(PolicyName(config.policy)),
                                       trailer.full_cache_bytes, wire_bytes);
    }
    return absl::OkStatus();
  }
};

PrefillServer::PrefillServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PrefillServer::~PrefillServer() { Shutdown(0); }

absl::StatusOr<std::unique_ptr<PrefillServer>> PrefillServer::Start(LlamaModel* model,
                                                                    PrefillServerOptions options) {
  if (options.workers < 1 || options.max_queue < 1) {
    return absl::InvalidArgumentError("--workers must be >= 1 and --max-queue >= 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->options = std::move(options);
  ASSIGN_OR_RETURN(auto creds, MakeServerCredentials(impl->options.tls));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(impl->options.listen, creds, &impl->port);
  builder.RegisterService(impl.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(impl->options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(kMaxChunkBytesLimit + (1 << 20)));
  // Connections age out so that decode nodes re-resolve the prefill Service now and then
  // and spread over new replicas; streams in flight get the grace period to finish.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, 10 * 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 2 * 60 * 1000);
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", impl->options.listen));
  }
  for (int i = 0; i < impl->options.workers; ++i) {
    impl->workers.emplace_back([p = impl.get()] { p->WorkerLoop(); });
  }
  return std::unique_ptr<PrefillServer>(new PrefillServer(std::move(impl)));
}

int PrefillServer::port() const { return impl_->port; }

void PrefillServer::Shutdown(int grace_ms) {
  if (impl_->server == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  // Queued jobs that never started still owe their streams a status.
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (auto& job : impl_->queue) {
      job->stream->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "prefill node shut down"));
    }
    impl_->queue.clear();
  }
  for (auto& t : impl_->workers) t.join();
  impl_->workers.clear();
  impl_->server.reset();
}

void PrefillServer::Wait() {
  if (impl_->server) impl_->server->Wait();
}

}  // namespace kvwire
