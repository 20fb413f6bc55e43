// A minimal HTTP/1.1 server for Prometheus scrapes: GET /metrics returns the text
// exposition format, anything else 404. One connection at a time, closed after each
// response; a scrape every few seconds needs nothing more. (prometheus-cpp's own civetweb
// exposer fails to start inside the node binaries, so the registry is served here.)
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace kvwire {

class MetricsHttpServer {
 public:
  // `listen` is "host:port" (port 0 picks a free one); `render` produces the body.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> render);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Serve();

  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::function<std::string()> render_;
  std::thread thread_;
};

}  // namespace kvwire
