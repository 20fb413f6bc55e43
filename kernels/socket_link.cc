#include "kernels/socket_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"

namespace kvwire::kernels {
namespace {

using SteadyTime = std::chrono::steady_clock::time_point;
constexpr absl::string_view kPrefix = "socket-link";
constexpr size_t kSecretBytes = 16;
std::atomic<int64_t> receive_delay_ms{0};  // SetSocketLinkReceiveDelay

absl::Status Errno(const char* what) {
  return absl::UnavailableError(absl::StrCat("socket link: ", what, ": ", std::strerror(errno)));
}

// Milliseconds left before `deadline` for poll (0 once past it).
int Remaining(SteadyTime deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left.count(), 1 << 30)));
}

absl::Status Expired() {
  return absl::DeadlineExceededError(
      "socket link: the peer did not complete its side in time; the link was aborted");
}

// Waits for `events` on fd until the deadline.
absl::Status PollFor(int fd, short events, SteadyTime deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, Remaining(deadline));
    if (n > 0) return absl::OkStatus();
    if (n == 0) return Expired();
    if (errno != EINTR) return Errno("poll");
  }
}

absl::Status WriteAll(int fd, const uint8_t* data, size_t bytes, SteadyTime deadline) {
  while (bytes > 0) {
    RETURN_IF_ERROR(PollFor(fd, POLLOUT, deadline));
    const ssize_t n = ::send(fd, data, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return Errno("send");
    }
    data += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, uint8_t* data, size_t bytes, SteadyTime deadline) {
  while (bytes > 0) {
    RETURN_IF_ERROR(PollFor(fd, POLLIN, deadline));
    const ssize_t n = ::recv(fd, data, bytes, MSG_DONTWAIT);
    if (n == 0) return absl::UnavailableError("socket link: the peer closed the link");
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return Errno("recv");
    }
    data += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

class SocketLink final : public PeerLink {
 public:
  SocketLink(KernelBackend* backend, std::string secret)
      : backend_(backend), secret_(std::move(secret)) {}
  ~SocketLink() override {
    if (listener_ >= 0) close(listener_);
    if (fd_ >= 0) close(fd_);
  }

  // The opener's end: listening, until the first operation accepts the joiner.
  absl::StatusOr<int> Listen() {
    listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener_ < 0) return Errno("socket");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Errno("bind");
    }
    if (listen(listener_, 4) != 0) return Errno("listen");
    if (getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return Errno("getsockname");
    }
    return ntohs(addr.sin_port);
  }
  void set_port(int port) { port_ = port; }

  absl::Status Send(const void* data, size_t bytes, std::chrono::milliseconds timeout) override {
    const SteadyTime deadline = std::chrono::steady_clock::now() + timeout;
    return Guard([&]() -> absl::Status {
      buffer_.resize(8 + bytes);
      const uint64_t n = bytes;
      std::memcpy(buffer_.data(), &n, 8);  // little-endian hosts, as the wire
      RETURN_IF_ERROR(backend_->CopyToHost(buffer_.data() + 8, data, bytes));
      RETURN_IF_ERROR(Connected(deadline));
      return WriteAll(fd_, buffer_.data(), buffer_.size(), deadline);
    });
  }
  absl::Status Recv(void* data, size_t bytes, std::chrono::milliseconds timeout) override {
    const SteadyTime deadline = std::chrono::steady_clock::now() + timeout;
    if (const int64_t delay = receive_delay_ms.load(std::memory_order_relaxed); delay > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    }
    return Guard([&]() -> absl::Status {
      RETURN_IF_ERROR(Connected(deadline));
      uint64_t n = 0;
      RETURN_IF_ERROR(ReadAll(fd_, reinterpret_cast<uint8_t*>(&n), 8, deadline));
      if (n != bytes) {
        return absl::DataLossError(absl::StrCat("socket link: the peer sent ", n,
                                                " bytes where a receive of ", bytes,
                                                " was posted; the link is out of step"));
      }
      buffer_.resize(bytes);
      RETURN_IF_ERROR(ReadAll(fd_, buffer_.data(), bytes, deadline));
      RETURN_IF_ERROR(backend_->CopyToDevice(data, buffer_.data(), bytes));
      return backend_->Synchronize();
    });
  }
  void Abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
    if (listener_ >= 0) shutdown(listener_, SHUT_RDWR);
  }

 private:
  // Runs one operation; any failure aborts the link, as NCCL's would.
  template <typename F>
  absl::Status Guard(F&& op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return absl::CancelledError("socket link: aborted");
    }
    absl::Status st = op();
    if (!st.ok()) Abort();
    return st;
  }

  // The connection, made on first use: the opener accepts the joiner that knows the secret,
  // the joiner connects and presents it.
  absl::Status Connected(SteadyTime deadline) {
    if (fd_ >= 0) return absl::OkStatus();
    if (listener_ < 0) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return Errno("socket");
      {
        std::lock_guard<std::mutex> lock(mu_);
        fd_ = fd;
        if (aborted_) shutdown(fd_, SHUT_RDWR);
      }
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(port_));
      if (connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        return Errno("connect");
      }
      NoDelay(fd_);
      return WriteAll(fd_, reinterpret_cast<const uint8_t*>(secret_.data()), secret_.size(),
                      deadline);
    }
    while (true) {
      RETURN_IF_ERROR(PollFor(listener_, POLLIN, deadline));
      const int fd = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
        return Errno("accept");
      }
      std::string got(secret_.size(), '\0');
      if (ReadAll(fd, reinterpret_cast<uint8_t*>(got.data()), got.size(), deadline).ok() &&
          got == secret_) {
        NoDelay(fd);
        std::lock_guard<std::mutex> lock(mu_);
        fd_ = fd;
        close(listener_);
        listener_ = -1;
        if (aborted_) shutdown(fd_, SHUT_RDWR);
        return absl::OkStatus();
      }
      close(fd);  // not our peer
    }
  }
  static void NoDelay(int fd) {
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }

  KernelBackend* const backend_;
  const std::string secret_;
  int port_ = 0;
  std::mutex mu_;  // aborted_, and fd_ / listener_ against Abort
  bool aborted_ = false;
  int listener_ = -1, fd_ = -1;
  std::vector<uint8_t> buffer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerLink>> OpenSocketLink(KernelBackend* backend,
                                                         std::string* offer) {
  std::random_device rd;
  std::string secret(kSecretBytes, '\0');
  for (char& c : secret) c = static_cast<char>(rd());
  auto link = std::make_unique<SocketLink>(backend, secret);
  ASSIGN_OR_RETURN(int port, link->Listen());
  *offer = absl::StrCat(kPrefix, ":", port, ":", absl::BytesToHexString(secret));
  return std::unique_ptr<PeerLink>(std::move(link));
}

absl::StatusOr<std::unique_ptr<PeerLink>> JoinSocketLink(KernelBackend* backend,
                                                         const std::string& offer) {
  const std::vector<std::string> f = absl::StrSplit(offer, ':');
  int port = 0;
  if (f.size() != 3 || f[0] != kPrefix || !absl::SimpleAtoi(f[1], &port) || port < 1 ||
      port > 65535 || f[2].size() != 2 * kSecretBytes ||
      f[2].find_first_not_of("0123456789abcdef") != std::string::npos) {
    return absl::InvalidArgumentError(
        "not a socket link offer: expected 'socket-link:PORT:' and 32 lowercase hex digits");
  }
  auto link = std::make_unique<SocketLink>(backend, absl::HexStringToBytes(f[2]));
  link->set_port(port);
  return std::unique_ptr<PeerLink>(std::move(link));
}

void SetSocketLinkReceiveDelay(std::chrono::milliseconds delay) {
  receive_delay_ms.store(delay.count(), std::memory_order_relaxed);
}

}  // namespace kvwire::kernels
