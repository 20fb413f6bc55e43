#include "decode_service/prefill_router.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/splitmix.h"

namespace kvwire {
namespace {

// SplitMix64 spreads consecutive inputs over the ring.
uint64_t Mix(uint64_t x) { return SplitMix64(x); }
uint64_t HashString(absl::string_view s) {
  uint64_t h = 0x84222325cbf29ce4ull;
  for (unsigned char c : s) h = Mix(h ^ c);
  return h;
}

// "ipv4:HOST:PORT" for each address `host` resolves to (IPv4), sorted.
absl::StatusOr<std::vector<std::string>> Resolve(const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("resolving prefill nodes ", host, ": ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char ip[64] = {0};
    if (getnameinfo(a->ai_addr, a->ai_addrlen, ip, sizeof(ip), nullptr, 0, NI_NUMERICHOST) == 0) {
      out.push_back(absl::StrCat("ipv4:", ip, ":", port));
    }
  }
  freeaddrinfo(found);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillRouter>> PrefillRouter::Create(
    const std::string& target, int key_tokens,
    std::function<std::shared_ptr<grpc::Channel>(const std::string&)> channel) {
  if (key_tokens < 1) return absl::InvalidArgumentError("the routing key needs >= 1 token");
  std::unique_ptr<PrefillRouter> r(new PrefillRouter());
  r->key_tokens_ = key_tokens;
  r->make_channel_ = std::move(channel);
  std::vector<std::string> addresses;
  if (absl::StartsWith(target, "ipv4:")) {
    for (absl::string_view a : absl::StrSplit(target.substr(5), ',', absl::SkipEmpty())) {
      addresses.push_back(absl::StrCat("ipv4:", a));
    }
  } else {
    std::string hostport = target;
    const bool dns = absl::StartsWith(target, "dns:///");
    if (dns) hostport = target.substr(7);
    const size_t colon = hostport.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == hostport.size() ||
        hostport.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "affinity routing takes an ipv4:HOST:PORT,... list, HOST:PORT or dns:///NAME:PORT; got '",
          target, "'"));
    }
    r->dns_host_ = hostport.substr(0, colon);
    r->dns_port_ = hostport.substr(colon + 1);
    // A name that does not resolve yet (pods still starting) is resolved again later.
    auto resolved = Resolve(r->dns_host_, r->dns_port_);
    if (resolved.ok()) addresses = *std::move(resolved);
    r->resolver_ = std::thread([raw = r.get()] { raw->ResolveLoop(); });
  }
  r->SetNodes(std::move(addresses));
  return r;
}

PrefillRouter::~PrefillRouter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (resolver_.joinable()) resolver_.join();
}

void PrefillRouter::ResolveLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, kResolveEvery, [&] { return stopping_; })) {
    lock.unlock();
    auto resolved = Resolve(dns_host_, dns_port_);
    if (resolved.ok()) SetNodes(*std::move(resolved));  // a failure keeps the last nodes
    lock.lock();
  }
}

void PrefillRouter::SetNodes(std::vector<std::string> addresses) {
  std::map<std::string, std::shared_ptr<Node>> nodes;
  std::vector<std::pair<uint64_t, std::string>> ring;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& a : addresses) {
      if (auto it = nodes_.find(a); it != nodes_.end()) nodes[a] = it->second;
    }
  }
  for (const std::string& a : addresses) {
    if (nodes.count(a) == 0) {
      auto n = std::make_shared<Node>();
      n->channel = make_channel_(a);
      n->stub = v1::Prefill::NewStub(n->channel);
      nodes[a] = std::move(n);
    }
    for (int i = 0; i < kPointsPerNode; ++i) {
      ring.emplace_back(Mix(HashString(a) + static_cast<uint64_t>(i)), a);
    }
  }
  std::sort(ring.begin(), ring.end());
  std::lock_guard<std::mutex> lock(mu_);
  nodes_ = std::move(nodes);
  ring_ = std::move(ring);
}

uint64_t PrefillRouter::Key(absl::Span<const int32_t> prompt) const {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  const size_t n = std::min(prompt.size(), static_cast<size_t>(key_tokens_));
  for (size_t i = 0; i < n; ++i) h = Mix(h ^ static_cast<uint32_t>(prompt[i]));
  return h;
}

PrefillRouter::Pick PrefillRouter::Route(uint64_t key, int attempt) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ring_.empty()) return {};
  // The nodes in ring order from the key.
  auto it = std::lower_bound(ring_.begin(), ring_.end(), std::make_pair(key, std::string()));
  std::vector<std::string> order;
  for (size_t step = 0; step < ring_.size() && order.size() < nodes_.size(); ++step, ++it) {
    if (it == ring_.end()) it = ring_.begin();
    if (std::find(order.begin(), order.end(), it->second) == order.end()) {
      order.push_back(it->second);
    }
  }
  auto healthy = [&](const std::string& a) {
    const grpc_connectivity_state s = nodes_.at(a)->channel->GetState(/*try_to_connect=*/true);
    return s != GRPC_CHANNEL_TRANSIENT_FAILURE && s != GRPC_CHANNEL_SHUTDOWN;
  };
  auto pick = [&](const std::string& a, const char* route) {
    std::shared_ptr<Node> n = nodes_.at(a);
    n->in_flight.fetch_add(1, std::memory_order_relaxed);
    v1::Prefill::Stub* stub = n->stub.get();
    // The keep releases the node's load when the call lets go of it.
    std::shared_ptr<const void> keep(
        stub, [n](const void*) { n->in_flight.fetch_sub(1, std::memory_order_relaxed); });
    return Pick{stub, a, route, std::move(keep)};
  };
  if (attempt == 0 && healthy(order[0])) return pick(order[0], kAffinity);
  // Fallback: the key's node refused, failed or is failing. The healthy others by load, then
  // the key's node again, so that a request waiting out a full tier comes back to it.
  std::vector<std::string> others;
  for (size_t i = 1; i < order.size(); ++i) {
    if (healthy(order[i])) others.push_back(order[i]);
  }
  std::stable_sort(others.begin(), others.end(), [&](const std::string& a, const std::string& b) {
    return nodes_.at(a)->in_flight.load(std::memory_order_relaxed) <
           nodes_.at(b)->in_flight.load(std::memory_order_relaxed);
  });
  if (healthy(order[0])) others.push_back(order[0]);
  if (others.empty()) {  // none healthy: each in turn, so that retries still reach every one
    const std::string& a = order[static_cast<size_t>(attempt) % order.size()];
    return pick(a, a == order[0] ? kAffinity : kFallback);
  }
  const std::string& a = others[static_cast<size_t>(std::max(attempt - 1, 0)) % others.size()];
  return pick(a, a == order[0] ? kAffinity : kFallback);
}

std::map<std::string, int> PrefillRouter::load() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, int> out;
  for (const auto& [a, n] : nodes_) out[a] = n->in_flight.load(std::memory_order_relaxed);
  return out;
}

}  // namespace kvwire
