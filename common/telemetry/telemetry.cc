#include "common/telemetry/telemetry.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <cctype>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/telemetry/metrics_http.h"

namespace kvwire {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool IsLowerHex(absl::string_view s, size_t n) {
  if (s.size() != n) return false;
  bool nonzero = false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
    nonzero |= c != '0';
  }
  return nonzero;
}

using Buckets = prometheus::Histogram::BucketBoundaries;

// Buckets sized for LLM serving: milliseconds to minutes.
const Buckets kTtft = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
const Buckets kItl = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};
const Buckets kRequest = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
const Buckets kQueue = {0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60};
const Buckets kForward = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
const Buckets kCompress = {1e-5, 5e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1};
const Buckets kTransfer = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05,
                           0.1,    0.25,   0.5,   1,     5,    30};
// Below 1 too: an uncompressed transfer carries positions and framing beyond the K/V.
const Buckets kRatio = {0.5, 0.75, 0.9, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128};

}  // namespace

// ------------------------------------------------------------------ trace context

TraceContext TraceContext::Parse(absl::string_view tp) {
  // version "00": 2 + 1 + 32 + 1 + 16 + 1 + 2 = 55 characters.
  TraceContext ctx;
  if (tp.size() < 55 || tp[2] != '-' || tp[35] != '-' || tp[52] != '-') return ctx;
  const absl::string_view version = tp.substr(0, 2);
  if (version == "ff" || !std::isxdigit(version[0]) || !std::isxdigit(version[1])) return ctx;
  if (version == "00" && tp.size() != 55) return ctx;
  const absl::string_view trace = tp.substr(3, 32), span = tp.substr(36, 16),
                          flags = tp.substr(53, 2);
  if (!IsLowerHex(trace, 32) || !IsLowerHex(span, 16)) return ctx;
  if (!std::isxdigit(flags[0]) || !std::isxdigit(flags[1])) return ctx;
  ctx.trace_id = std::string(trace);
  ctx.span_id = std::string(span);
  ctx.sampled = (std::stoi(std::string(flags), nullptr, 16) & 1) != 0;
  return ctx;
}

std::string TraceContext::ToTraceparent() const {
  return absl::StrCat("00-", trace_id, "-", span_id, sampled ? "-01" : "-00");
}

std::string RandomHex(int digits) {
  thread_local std::mt19937_64 rng(std::random_device{}() ^ static_cast<uint64_t>(NowNs()) ^
                                   std::hash<std::thread::id>{}(std::this_thread::get_id()));
  static const char* kHex = "0123456789abcdef";
  std::string s;
  while (static_cast<int>(s.size()) < digits) {
    uint64_t r = rng();
    for (int i = 0; i < 16 && static_cast<int>(s.size()) < digits; ++i, r >>= 4) s += kHex[r & 15];
  }
  if (s.find_first_not_of('0') == std::string::npos) s.back() = '1';  // all-zero is invalid
  return s;
}

// ------------------------------------------------------------------ spans

Span::Span(Tracer* tracer, std::string name, const TraceContext& parent)
    : tracer_(tracer), name_(std::move(name)), start_ns_(NowNs()) {
  ctx_.trace_id = parent.valid() ? parent.trace_id : RandomHex(32);
  ctx_.sampled = parent.valid() ? parent.sampled : true;
  ctx_.span_id = RandomHex(16);
  if (parent.valid()) parent_span_id_ = parent.span_id;
}

Span::Span(Span&& o) noexcept { *this = std::move(o); }

Span& Span::operator=(Span&& o) noexcept {
  if (this != &o) {
    End();
    tracer_ = o.tracer_;
    name_ = std::move(o.name_);
    ctx_ = std::move(o.ctx_);
    parent_span_id_ = std::move(o.parent_span_id_);
    start_ns_ = o.start_ns_;
    attributes_ = std::move(o.attributes_);
    error_ = std::move(o.error_);
    o.tracer_ = nullptr;
  }
  return *this;
}

void Span::SetAttribute(const std::string& key, const std::string& value) {
  if (tracer_) attributes_.emplace_back(key, value);
}
void Span::SetAttribute(const std::string& key, int64_t value) {
  if (tracer_) attributes_.emplace_back(key, value);
}
void Span::SetAttribute(const std::string& key, double value) {
  if (tracer_) attributes_.emplace_back(key, value);
}
void Span::SetError(const absl::Status& status) {
  if (tracer_ && !status.ok()) error_ = status.ToString();
}

void Span::End() {
  if (tracer_ == nullptr) return;
  Tracer* t = tracer_;
  tracer_ = nullptr;
  if (ctx_.sampled) t->Export(*this, NowNs());
}

Tracer::Tracer(std::string service_name, std::string node, std::FILE* out, bool owns)
    : service_name_(std::move(service_name)), node_(std::move(node)), out_(out), owns_(owns) {}

Tracer::~Tracer() {
  if (owns_ && out_) std::fclose(out_);
}

void Tracer::Export(const Span& s, int64_t end_ns) {
  using nlohmann::json;
  json attrs = json::array();
  for (const auto& [key, value] : s.attributes_) {
    json v;
    if (const auto* str = std::get_if<std::string>(&value)) {
      v = {{"stringValue", *str}};
    } else if (const auto* i = std::get_if<int64_t>(&value)) {
      v = {{"intValue", std::to_string(*i)}};  // OTLP-JSON encodes int64 as a string
    } else {
      v = {{"doubleValue", std::get<double>(value)}};
    }
    attrs.push_back({{"key", key}, {"value", v}});
  }
  json span = {
      {"traceId", s.ctx_.trace_id},
      {"spanId", s.ctx_.span_id},
      {"name", s.name_},
      {"kind", 1},  // SPAN_KIND_INTERNAL
      {"startTimeUnixNano", std::to_string(s.start_ns_)},
      {"endTimeUnixNano", std::to_string(end_ns)},
      {"attributes", attrs},
      {"status", s.error_.empty() ? json{{"code", 1}} : json{{"code", 2}, {"message", s.error_}}}};
  if (!s.parent_span_id_.empty()) span["parentSpanId"] = s.parent_span_id_;
  json resource = {{"attributes",
                    {{{"key", "service.name"}, {"value", {{"stringValue", service_name_}}}},
                     {{"key", "service.instance.id"}, {"value", {{"stringValue", node_}}}}}}};
  json line = {{"resourceSpans",
                {{{"resource", resource},
                  {"scopeSpans", {{{"scope", {{"name", "kvwire"}}}, {"spans", {span}}}}}}}}};
  const std::string text = line.dump() + "\n";
  std::lock_guard<std::mutex> lock(mu_);
  std::fwrite(text.data(), 1, text.size(), out_);
  std::fflush(out_);
}

// ------------------------------------------------------------------ metrics

std::string StatusLabel(const absl::Status& status) {
  if (status.ok()) return "ok";
  std::string name = absl::StatusCodeToString(status.code());
  return absl::AsciiStrToLower(name);
}

struct Telemetry::Metrics {
  prometheus::Family<prometheus::Counter>* requests;
  prometheus::Family<prometheus::Counter>* kv_full_bytes;
  prometheus::Family<prometheus::Counter>* kv_wire_bytes;
  prometheus::Family<prometheus::Counter>* transfer_failures;
  prometheus::Family<prometheus::Histogram>* ratio;
  prometheus::Histogram* transfer_seconds;
  prometheus::Histogram* ttft;
  prometheus::Histogram* itl;
  prometheus::Histogram* request_seconds;
  prometheus::Histogram* queue_seconds;
  prometheus::Histogram* forward_seconds;
  prometheus::Histogram* compress_seconds;
  prometheus::Gauge* queued;
  prometheus::Gauge* active;
  prometheus::Gauge* pool_used;
  prometheus::Gauge* pool_capacity;
  prometheus::Counter* prompt_tokens;
  prometheus::Counter* generated_tokens;
  prometheus::Counter* prefix_hit_tokens;
  prometheus::Counter* prefix_miss_tokens;
  prometheus::Gauge* prefix_bytes;
  prometheus::Gauge* prefix_evictions;  // the cache's own count, mirrored
  prometheus::Family<prometheus::Counter>* prefill_routes;
};

absl::StatusOr<std::unique_ptr<Telemetry>> Telemetry::Create(const TelemetryOptions& options) {
  if (options.role != "prefill" && options.role != "decode") {
    return absl::InvalidArgumentError(
        absl::StrCat("telemetry role must be prefill or decode, got '", options.role, "'"));
  }
  std::unique_ptr<Telemetry> t(new Telemetry());
  t->options_ = options;
  t->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *t->registry_;
  const prometheus::Labels base = {{"role", options.role}, {"node", options.node}};
  auto counter = [&](const char* name,
                     const char* help) -> prometheus::Family<prometheus::Counter>& {
    return prometheus::BuildCounter().Name(name).Help(help).Labels(base).Register(r);
  };
  auto hist = [&](const char* name,
                  const char* help) -> prometheus::Family<prometheus::Histogram>& {
    return prometheus::BuildHistogram().Name(name).Help(help).Labels(base).Register(r);
  };
  auto gauge = [&](const char* name, const char* help) -> prometheus::Gauge& {
    return prometheus::BuildGauge().Name(name).Help(help).Labels(base).Register(r).Add({});
  };
  auto m = std::make_unique<Metrics>();
  m->requests = &counter("kvwire_requests_total", "Requests finished, by final gRPC status.");
  m->kv_full_bytes = &counter("kvwire_kv_full_bytes_total",
                              "K/V bytes the uncompressed prompt cache would have moved.");
  m->kv_wire_bytes = &counter("kvwire_kv_wire_bytes_total",
                              "KV stream bytes that crossed the wire (serialized messages).");
  m->transfer_failures =
      &counter("kvwire_kv_transfer_failures_total", "KV transfers that failed, by reason.");
  m->ratio = &hist("kvwire_kv_compression_ratio", "Full-cache bytes over wire bytes, per request.");
  m->transfer_seconds =
      &hist("kvwire_kv_transfer_seconds", "First KV byte to trailer, per request.")
           .Add({}, kTransfer);
  m->ttft = &hist("kvwire_time_to_first_token_seconds", "Request arrival to the first token sent.")
                 .Add({}, kTtft);
  m->itl =
      &hist("kvwire_inter_token_latency_seconds", "Time between consecutive tokens.").Add({}, kItl);
  m->request_seconds =
      &hist("kvwire_request_duration_seconds", "Request arrival to its end.").Add({}, kRequest);
  m->queue_seconds =
      &hist("kvwire_queue_seconds", "Time waiting for admission or a worker.").Add({}, kQueue);
  m->forward_seconds =
      &hist("kvwire_prefill_forward_seconds", "Prefill forward pass, compression included.")
           .Add({}, kForward);
  m->compress_seconds =
      &hist("kvwire_compression_seconds", "Selecting and gathering the kept K/V, per request.")
           .Add({}, kCompress);
  m->queued = &gauge("kvwire_queued_requests", "Requests waiting.");
  m->active = &gauge("kvwire_active_sequences", "Requests being served.");
  m->pool_used = &gauge("kvwire_kv_pool_used_bytes", "KV pool bytes reserved by sequences.");
  m->pool_capacity = &gauge("kvwire_kv_pool_capacity_bytes", "KV pool size.");
  m->prompt_tokens = &counter("kvwire_prompt_tokens_total", "Prompt tokens processed.").Add({});
  m->generated_tokens = &counter("kvwire_generated_tokens_total", "Tokens generated.").Add({});
  m->prefix_hit_tokens = &counter("kvwire_prefix_cache_hit_tokens_total",
                                  "Prompt tokens whose K/V came from the prefix cache.")
                              .Add({});
  m->prefix_miss_tokens = &counter("kvwire_prefix_cache_miss_tokens_total",
                                   "Prompt tokens computed, where a prefix cache is on.")
                               .Add({});
  m->prefix_bytes = &gauge("kvwire_prefix_cache_bytes", "Bytes the prefix cache holds.");
  m->prefix_evictions =
      &gauge("kvwire_prefix_cache_evictions", "Prefix cache blocks evicted since the start.");
  m->prefill_routes = &counter("kvwire_prefill_routes_total",
                               "Prefill attempts sent to a prefill node, by how it was chosen.");
  t->metrics_ = std::move(m);

  if (!options.metrics_listen.empty()) {
    Telemetry* raw = t.get();
    ASSIGN_OR_RETURN(t->http_, MetricsHttpServer::Start(options.metrics_listen,
                                                        [raw] { return raw->Scrape(); }));
    t->metrics_port_ = t->http_->port();
  }
  if (!options.trace_file.empty()) {
    std::FILE* out =
        options.trace_file == "-" ? stderr : std::fopen(options.trace_file.c_str(), "a");
    if (out == nullptr) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot open trace file ", options.trace_file));
    }
    t->tracer_ = std::make_unique<Tracer>(absl::StrCat("kvwire-", options.role), options.node, out,
                                          options.trace_file != "-");
  }
  return t;
}

Telemetry::~Telemetry() = default;

std::string Telemetry::Scrape() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

Span Telemetry::StartSpan(const std::string& name, const TraceContext& parent) {
  if (!tracer_) return Span();
  return Span(tracer_.get(), name, parent);
}

void Telemetry::CountRequest(const absl::Status& status) {
  metrics_->requests->Add({{"status", StatusLabel(status)}}).Increment();
}
void Telemetry::SetQueued(double n) { metrics_->queued->Set(n); }
void Telemetry::SetActive(double n) { metrics_->active->Set(n); }
void Telemetry::ObserveQueue(double s) { metrics_->queue_seconds->Observe(s); }
void Telemetry::ObservePrefill(double forward_s, double compress_s) {
  metrics_->forward_seconds->Observe(forward_s);
  metrics_->compress_seconds->Observe(compress_s);
}
void Telemetry::CountTransfer(const std::string& transport, const std::string& policy,
                              int64_t full_bytes, int64_t wire_bytes) {
  const prometheus::Labels labels = {{"transport", transport}, {"policy", policy}};
  metrics_->kv_full_bytes->Add(labels).Increment(static_cast<double>(full_bytes));
  metrics_->kv_wire_bytes->Add(labels).Increment(static_cast<double>(wire_bytes));
  if (wire_bytes > 0) {
    metrics_->ratio->Add({{"policy", policy}}, kRatio)
        .Observe(static_cast<double>(full_bytes) / static_cast<double>(wire_bytes));
  }
}
void Telemetry::ObserveTransfer(double s) { metrics_->transfer_seconds->Observe(s); }
void Telemetry::CountTransferFailure(const std::string& reason) {
  metrics_->transfer_failures->Add({{"reason", reason}}).Increment();
}
void Telemetry::ObserveTtft(double s) { metrics_->ttft->Observe(s); }
void Telemetry::ObserveItl(double s) { metrics_->itl->Observe(s); }
void Telemetry::ObserveRequest(double s) { metrics_->request_seconds->Observe(s); }
void Telemetry::CountTokens(int64_t prompt, int64_t generated) {
  metrics_->prompt_tokens->Increment(static_cast<double>(prompt));
  metrics_->generated_tokens->Increment(static_cast<double>(generated));
}
void Telemetry::CountPrefix(int64_t hit_tokens, int64_t miss_tokens, double bytes,
                            int64_t evictions) {
  metrics_->prefix_hit_tokens->Increment(static_cast<double>(hit_tokens));
  metrics_->prefix_miss_tokens->Increment(static_cast<double>(miss_tokens));
  metrics_->prefix_bytes->Set(bytes);
  metrics_->prefix_evictions->Set(static_cast<double>(evictions));
}
void Telemetry::CountRoute(const std::string& route) {
  metrics_->prefill_routes->Add({{"route", route}}).Increment();
}
void Telemetry::SetPool(double used, double capacity) {
  metrics_->pool_used->Set(used);
  metrics_->pool_capacity->Set(capacity);
}

}  // namespace kvwire
