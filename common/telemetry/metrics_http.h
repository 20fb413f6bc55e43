// A minimal HTTP/1.1 server for Prometheus scrapes: GET /metrics returns the text
// exposition format, anything else 404. One connection at a time, closed after each
// response; a scrape every few seconds needs nothing more.
//
// Why not prometheus-cpp's own exposer (prometheus::Exposer): Debian builds civetweb, which
// it runs on, with a fixed 100 KiB stack for its worker threads (USE_STACK_SIZE=0x19000),
// and glibc carves a process's static TLS out of every thread's stack. The node binaries
// link OpenBLAS (60 KiB of static TLS) and, in CUDA builds, cuBLAS/cuBLASLt (another 100 KiB),
// so pthread_create fails with EINVAL and the exposer cannot start ("Cannot create threads:
// error 0"). tests/common/telemetry/exposer_test.cc reproduces this with the nodes'
// libraries and fails the day the exposer can serve there, when this file can go.
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
