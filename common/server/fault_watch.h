// Takes a node out of service when its device faults for good (the probe: the node's
// KernelBackend::fault(); CUDA's sticky errors leave the context unusable until the process
// restarts). Its gRPC health goes
// NOT_SERVING, so that Kubernetes' readiness probe and the router stop sending it requests, and
// every new request is refused at once saying why, instead of failing on the device one by one.
// A background thread polls the backend, so the health changes with no request in flight.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"

namespace kvwire {

class FaultWatch {
 public:
  static constexpr auto kPollEvery = std::chrono::milliseconds(500);

  // `probe` returns the device's fault, or OK; null: nothing to watch. `node`: the node's name,
  // for the log line and the refusal.
  FaultWatch(std::function<absl::Status()> probe, std::string node);
  ~FaultWatch();
  FaultWatch(const FaultWatch&) = delete;
  FaultWatch& operator=(const FaultWatch&) = delete;

  // The server whose health goes NOT_SERVING on a fault (set once it is built).
  void Attach(grpc::Server* server);
  // OK, or UNAVAILABLE naming the fault (and the node taken out of service now, if the poll has
  // not yet done it).
  absl::Status Check();

 private:
  void Trip(const absl::Status& fault);
  void Loop();

  const std::function<absl::Status()> probe_;
  const std::string node_;
  std::atomic<bool> faulted_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  grpc::Server* server_ = nullptr;  // under mu_
  bool stopping_ = false;           // under mu_
  std::thread thread_;
};

}  // namespace kvwire
