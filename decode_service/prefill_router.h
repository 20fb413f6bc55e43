// Affinity routing of prefills (--prefill-affinity-tokens): the prefill node for a request is
// the one a consistent-hash ring of the target's nodes gives its prompt's leading tokens, so that
// requests that start the same (questions on one document, a conversation's turns) reach the
// node whose prefix cache holds them (as llm-d's and Dynamo's KV-aware routers do). When that
// node's channel is failing, or on a retry (it refused a full queue, failed or hung), the call
// falls back to the least loaded other node: the one with the fewest of this decode node's
// prefills in flight (Envoy's least-request balancing; a decode node sees only its own calls).
// The caller falls back to its round-robin channel when the ring has no node.
//
// The nodes come from the target: an "ipv4:" list, "host:port", or "dns:///name:port"
// (re-resolved every kResolveEvery: a Kubernetes headless Service's pods come and go). Each
// node gets a channel of its own, made as the caller's round-robin one is.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvwire/v1/prefill.grpc.pb.h"

namespace kvwire {

class PrefillRouter {
 public:
  static constexpr auto kResolveEvery = std::chrono::seconds(10);
  static constexpr int kPointsPerNode = 64;  // virtual nodes: an even spread over few nodes

  // `channel(address)` makes a channel to one node ("ipv4:10.0.0.1:50052"). `key_tokens`:
  // how many leading prompt tokens pick the node (a prefill node's block: prompts that share
  // them share its first cached block).
  static absl::StatusOr<std::unique_ptr<PrefillRouter>> Create(
      const std::string& target, int key_tokens,
      std::function<std::shared_ptr<grpc::Channel>(const std::string&)> channel);
  ~PrefillRouter();

  // The key of a prompt: a hash of its first key_tokens tokens (all of a shorter prompt).
  uint64_t Key(absl::Span<const int32_t> prompt) const;
  struct Pick {
    v1::Prefill::Stub* stub = nullptr;  // null: the ring has no node
    std::string node;                   // its address
    // kAffinity: the node the key maps to; kFallback: the least loaded other one.
    const char* route = "";
    // Keeps the stub, and counts the call in the node's load, until it is released.
    std::shared_ptr<const void> keep;
  };
  static constexpr const char* kAffinity = "affinity";
  static constexpr const char* kFallback = "fallback";
  // Attempt 0 (the request's first): the key's node, unless its channel is failing. Attempt
  // k > 0, or a failing key's node: the (k-1)-th of the healthy other nodes ordered by load
  // (ties in ring order) followed by the key's node; when none is healthy, the k-th node in ring
  // order.
  Pick Route(uint64_t key, int attempt);
  // The nodes the ring holds now, and this node's calls in flight on each.
  std::map<std::string, int> load() const;

 private:
  PrefillRouter() = default;
  void SetNodes(std::vector<std::string> addresses);
  void ResolveLoop();

  struct Node {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Prefill::Stub> stub;
    std::atomic<int> in_flight{0};  // Picks not yet released
  };
  int key_tokens_ = 64;
  std::function<std::shared_ptr<grpc::Channel>(const std::string&)> make_channel_;
  std::string dns_host_, dns_port_;  // a dns:/// target, re-resolved
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Node>> nodes_;  // by address
  std::vector<std::pair<uint64_t, std::string>> ring_;  // sorted points
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread resolver_;
};

}  // namespace kvwire
