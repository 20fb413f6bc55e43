// Observability of a node: Prometheus metrics (prometheus-cpp, served on --metrics-listen)
// and traces (W3C traceparent, carried in gRPC metadata by common/server; spans exported as
// OTLP-JSON lines, one ExportTraceServiceRequest per line, which an OpenTelemetry collector's
// otlpjsonfile receiver ingests).
//
// Metric names follow Prometheus conventions: kvwire_ prefix, base units in the name
// (_seconds, _bytes), _total for counters. Every series carries the node's `role`
// (prefill or decode) and `node` name. README.md lists them all.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace kvwire {

class MetricsHttpServer;

// W3C trace context (https://www.w3.org/TR/trace-context/): the `traceparent` header
// "00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>".
struct TraceContext {
  std::string trace_id;  // 32 lowercase hex digits, not all zero
  std::string span_id;   // 16 lowercase hex digits, not all zero
  bool sampled = true;

  bool valid() const { return !trace_id.empty() && !span_id.empty(); }
  // Invalid (empty) when the header is absent or malformed, as the spec asks.
  static TraceContext Parse(absl::string_view traceparent);
  std::string ToTraceparent() const;
};

std::string RandomHex(int digits);

class Tracer;

// A span; ends (and is exported) when End() is called or it is destroyed. A
// default-constructed span records nothing, so callers need no null checks.
class Span {
 public:
  Span() = default;
  Span(Tracer* tracer, std::string name, const TraceContext& parent);
  Span(Span&& other) noexcept;
  Span& operator=(Span&& other) noexcept;
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  ~Span() { End(); }

  void SetAttribute(const std::string& key, const std::string& value);
  void SetAttribute(const std::string& key, const char* value) {
    SetAttribute(key, std::string(value));
  }
  void SetAttribute(const std::string& key, int64_t value);
  void SetAttribute(const std::string& key, int value) { SetAttribute(key, int64_t{value}); }
  void SetAttribute(const std::string& key, double value);
  void SetError(const absl::Status& status);
  void End();
  // This span as the parent of others (the same trace id, this span's id).
  TraceContext context() const { return ctx_; }

 private:
  friend class Tracer;
  Tracer* tracer_ = nullptr;
  std::string name_;
  TraceContext ctx_;
  std::string parent_span_id_;
  int64_t start_ns_ = 0;
  std::vector<std::pair<std::string, std::variant<std::string, int64_t, double>>> attributes_;
  std::string error_;
};

// Writes finished spans as OTLP-JSON lines to a file or stderr.
class Tracer {
 public:
  Tracer(std::string service_name, std::string node, std::FILE* out, bool owns);
  ~Tracer();
  void Export(const Span& span, int64_t end_ns);

 private:
  std::string service_name_, node_;
  std::FILE* out_;
  bool owns_;
  std::mutex mu_;
};

struct TelemetryOptions {
  std::string role;            // "prefill" or "decode"
  std::string node = "node";   // node name label
  std::string metrics_listen;  // "0.0.0.0:9100", ":0" for any free port; empty: no endpoint
  std::string trace_file;      // OTLP-JSON lines: a path, "-" for stderr; empty: no traces
};

// "ok", or the gRPC status code name in lower case ("resource_exhausted", ...).
std::string StatusLabel(const absl::Status& status);

class Telemetry {
 public:
  static absl::StatusOr<std::unique_ptr<Telemetry>> Create(const TelemetryOptions& options);
  ~Telemetry();

  const std::string& role() const { return options_.role; }
  // The port /metrics is served on (0 when not served).
  int metrics_port() const { return metrics_port_; }
  prometheus::Registry& registry() { return *registry_; }
  // The exposition text of every metric, as /metrics serves it.
  std::string Scrape() const;

  Span StartSpan(const std::string& name, const TraceContext& parent);

  // Requests by final status.
  void CountRequest(const absl::Status& status);
  void SetQueued(double n);
  void SetActive(double n);
  void ObserveQueue(double seconds);
  // Prefill node: forward pass and the part spent compressing.
  void ObservePrefill(double forward_seconds, double compress_seconds);
  // KV bytes: what a full transfer would have moved and what crossed the wire.
  void CountTransfer(const std::string& transport, const std::string& policy, int64_t full_bytes,
                     int64_t wire_bytes);
  void ObserveTransfer(double seconds);
  void CountTransferFailure(const std::string& reason);
  // Decode node: latency of the request's tokens.
  void ObserveTtft(double seconds);
  void ObserveItl(double seconds);
  void ObserveRequest(double seconds);
  void CountTokens(int64_t prompt, int64_t generated);
  void SetPool(double used_bytes, double capacity_bytes);
  // Prefill node: a prompt's tokens found in the prefix cache and computed; the cache's bytes
  // and evictions so far.
  void CountPrefix(int64_t hit_tokens, int64_t miss_tokens, double bytes, int64_t evictions);
  // Decode node: a prefill attempt sent to a node, by how it was chosen ("affinity" to the node
  // holding the prompt's prefix, "fallback" to the least loaded other, "round_robin").
  void CountRoute(const std::string& route);

 private:
  struct Metrics;
  Telemetry() = default;

  TelemetryOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Tracer> tracer_;
  int metrics_port_ = 0;
};

}  // namespace kvwire
