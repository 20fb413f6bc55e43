#include "common/server/fault_watch.h"

#include <grpcpp/health_check_service_interface.h>

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace kvwire {

FaultWatch::FaultWatch(std::function<absl::Status()> probe, std::string node)
    : probe_(std::move(probe)), node_(std::move(node)) {
  if (probe_) thread_ = std::thread([this] { Loop(); });
}

FaultWatch::~FaultWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    server_ = nullptr;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void FaultWatch::Attach(grpc::Server* server) {
  bool now = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    server_ = server;
    now = faulted_.load();
  }
  if (now && server != nullptr) {
    if (auto* health = server->GetHealthCheckService()) health->SetServingStatus(false);
  }
}

absl::Status FaultWatch::Check() {
  if (!probe_) return absl::OkStatus();
  const absl::Status fault = probe_();
  if (fault.ok()) return absl::OkStatus();
  Trip(fault);
  return absl::UnavailableError(
      absl::StrCat("node ", node_, " is out of service: its device faulted (", fault.message(),
                   ") and every call on it fails until the node restarts"));
}

void FaultWatch::Trip(const absl::Status& fault) {
  if (faulted_.exchange(true)) return;
  std::fprintf(stderr, "%s: device fault, health NOT_SERVING until restart: %s\n", node_.c_str(),
               std::string(fault.message()).c_str());
  std::lock_guard<std::mutex> lock(mu_);
  if (server_ != nullptr) {
    if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
  }
}

void FaultWatch::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (cv_.wait_for(lock, kPollEvery, [&] { return stopping_; })) break;
    lock.unlock();
    const absl::Status fault = probe_();
    if (!fault.ok()) Trip(fault);
    lock.lock();
  }
}

}  // namespace kvwire
