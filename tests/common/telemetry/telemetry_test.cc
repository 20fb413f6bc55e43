// Metrics and traces: W3C traceparent parsing, the exposition served over HTTP (bound port,
// address forms, bind failures), and OTLP-JSON span lines with their parent/child links.
#include "common/telemetry/telemetry.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/test_util.h"

namespace kvwire {
namespace {

TEST(TraceContext, ParsesValidAndRejectsMalformed) {
  auto t = TraceContext::Parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
  ASSERT_TRUE(t.valid());
  EXPECT_EQ(t.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(t.span_id, "00f067aa0ba902b7");
  EXPECT_TRUE(t.sampled);
  EXPECT_EQ(t.ToTraceparent(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
  EXPECT_FALSE(
      TraceContext::Parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").sampled);
  for (const char* bad : {"", "garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                          "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                          "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                          "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                          "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"}) {
    EXPECT_FALSE(TraceContext::Parse(bad).valid()) << bad;
  }
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  ::send(fd, req.data(), req.size(), 0);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

TEST(Telemetry, ServesPrometheusText) {
  TelemetryOptions o;
  o.role = "decode";
  o.node = "d1";
  o.metrics_listen = "127.0.0.1:0";
  auto t = Telemetry::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  (*t)->CountTransfer("grpc", "snapkv", 8000, 1000);
  (*t)->CountRequest(absl::OkStatus());
  (*t)->CountRequest(absl::InvalidArgumentError("x"));
  (*t)->ObserveTtft(0.02);
  ASSERT_GT((*t)->metrics_port(), 0);
  const std::string r = HttpGet((*t)->metrics_port(), "/metrics");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  // The text exposition format Prometheus parses (it reads any text/plain page as such).
  EXPECT_NE(r.find("\r\nContent-Type: text/plain"), std::string::npos) << r;
  // Everything Scrape() renders is on the page.
  std::istringstream scraped((*t)->Scrape());
  for (std::string line; std::getline(scraped, line);) {
    EXPECT_NE(r.find(line), std::string::npos) << line;
  }
  EXPECT_NE(r.find("kvwire_kv_wire_bytes_total{node=\"d1\",role=\"decode\",policy=\"snapkv\","
                   "transport=\"grpc\"} 1000"),
            std::string::npos)
      << r;
  EXPECT_NE(
      r.find("kvwire_requests_total{node=\"d1\",role=\"decode\",status=\"invalid_argument\"} 1"),
      std::string::npos);
  EXPECT_NE(
      r.find("kvwire_kv_compression_ratio_bucket{node=\"d1\",role=\"decode\",policy=\"snapkv\","
             "le=\"8\"} 1"),
      std::string::npos);
  EXPECT_NE(r.find("kvwire_time_to_first_token_seconds_count"), std::string::npos);
  EXPECT_NE(HttpGet((*t)->metrics_port(), "/other").find("404"), std::string::npos);
}

// Port 0 in every address form ("127.0.0.1:0" is above): metrics_port() is the port the
// kernel picked.
TEST(Telemetry, ReportsTheBoundPortForPortZero) {
  for (const char* listen : {":0", "*:0", "localhost:0"}) {
    TelemetryOptions o;
    o.role = "prefill";
    o.metrics_listen = listen;
    auto t = Telemetry::Create(o);
    ASSERT_TRUE(t.ok()) << listen << ": " << t.status();
    ASSERT_GT((*t)->metrics_port(), 0) << listen;
    EXPECT_NE(HttpGet((*t)->metrics_port(), "/metrics").find("\nkvwire_queued_requests{"),
              std::string::npos)
        << listen;
  }
}

// A port another socket listens on is an Unavailable status that says why.
TEST(Telemetry, PortInUseIsUnavailable) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  TelemetryOptions o;
  o.role = "decode";
  o.metrics_listen = "127.0.0.1:" + std::to_string(port);
  auto t = Telemetry::Create(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable) << t.status();
  EXPECT_NE(t.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << t.status();
  EXPECT_NE(t.status().message().find("Address already in use"), std::string::npos) << t.status();
  ::close(fd);
  // Free again: served there, and released when the Telemetry goes.
  for (int i = 0; i < 2; ++i) {
    auto again = Telemetry::Create(o);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ((*again)->metrics_port(), port);
  }
}

TEST(Telemetry, BadOptionsAreErrors) {
  TelemetryOptions o;
  o.role = "router";
  EXPECT_EQ(Telemetry::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.role = "prefill";
  for (const char* bad :
       {"nonsense", "127.0.0.1", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:http"}) {
    o.metrics_listen = bad;
    EXPECT_EQ(Telemetry::Create(o).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  o.metrics_listen = "";
  o.trace_file = "/nonexistent/dir/spans.jsonl";
  EXPECT_FALSE(Telemetry::Create(o).ok());
}

TEST(Telemetry, SpansAreOtlpJsonLinesWithParents) {
  const std::string path = testing::MakeTempDir("spans") + "/spans.jsonl";
  TelemetryOptions o;
  o.role = "prefill";
  o.node = "p1";
  o.trace_file = path;
  auto t = Telemetry::Create(o);
  ASSERT_TRUE(t.ok());
  const TraceContext parent =
      TraceContext::Parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
  {
    Span outer = (*t)->StartSpan("outer", parent);
    outer.SetAttribute("kv.wire_bytes", int64_t{1234});
    outer.SetAttribute("policy", "snapkv");
    Span inner = (*t)->StartSpan("inner", outer.context());
    inner.SetError(absl::DataLossError("bad chunk"));
  }
  t->reset();  // flushes and closes the file
  std::vector<nlohmann::json> spans;
  std::istringstream in(testing::ReadFile(path));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["resourceSpans"][0]["resource"]["attributes"][0]["value"]["stringValue"],
              "kvwire-prefill");
    spans.push_back(j["resourceSpans"][0]["scopeSpans"][0]["spans"][0]);
  }
  ASSERT_EQ(spans.size(), 2u);  // inner ends first
  const auto& inner = spans[0];
  const auto& outer = spans[1];
  EXPECT_EQ(outer["name"], "outer");
  EXPECT_EQ(outer["traceId"], parent.trace_id);
  EXPECT_EQ(outer["parentSpanId"], parent.span_id);
  EXPECT_EQ(inner["traceId"], parent.trace_id);
  EXPECT_EQ(inner["parentSpanId"], outer["spanId"]);
  EXPECT_EQ(inner["status"]["code"], 2);
  EXPECT_EQ(outer["attributes"][0]["key"], "kv.wire_bytes");
  EXPECT_EQ(outer["attributes"][0]["value"]["intValue"], "1234");
  EXPECT_LE(std::stoll(outer["startTimeUnixNano"].get<std::string>()),
            std::stoll(inner["startTimeUnixNano"].get<std::string>()));
}

}  // namespace
}  // namespace kvwire
