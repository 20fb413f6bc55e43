// PrefillRouter: the ring's spread, affinity, the least-loaded fallback, and failing nodes.
#include "decode_service/prefill_router.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace kvwire {
namespace {

// Prefill nodes that only accept connections (a health service), so that channels to them
// become READY; Shutdown makes one fail.
class Nodes {
 public:
  explicit Nodes(int n) {
    grpc::EnableDefaultHealthCheckService(true);
    for (int i = 0; i < n; ++i) {
      int port = 0;
      grpc::ServerBuilder b;
      b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      servers_.push_back(b.BuildAndStart());
      addresses_.push_back("ipv4:127.0.0.1:" + std::to_string(port));
    }
  }
  std::string target() const {
    std::string t = "ipv4:";
    for (size_t i = 0; i < addresses_.size(); ++i) {
      if (i > 0) t += ',';
      t.append(addresses_[i], 5);  // without "ipv4:"
    }
    return t;
  }
  const std::vector<std::string>& addresses() const { return addresses_; }
  void Shutdown(const std::string& address) {
    for (size_t i = 0; i < addresses_.size(); ++i) {
      if (addresses_[i] == address) servers_[i]->Shutdown(std::chrono::system_clock::now());
    }
  }

 private:
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> addresses_;
};

std::unique_ptr<PrefillRouter> MakeRouter(const std::string& target, int key_tokens = 4) {
  auto r = PrefillRouter::Create(target, key_tokens, [](const std::string& a) {
    return grpc::CreateChannel(a, grpc::InsecureChannelCredentials());
  });
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

std::vector<int32_t> Prompt(int doc, int len) {
  std::vector<int32_t> ids;
  for (int t = 0; t < len; ++t) ids.push_back(3 + (doc * 131 + t * 7) % 400);
  return ids;
}

TEST(PrefillRouter, SpreadsKeysOverTheNodesAndKeepsEachKeysNode) {
  Nodes nodes(3);
  auto router = MakeRouter(nodes.target());
  ASSERT_NE(router, nullptr);
  std::map<std::string, int> count;
  for (int doc = 0; doc < 600; ++doc) {
    const uint64_t key = router->Key(Prompt(doc, 20));
    const PrefillRouter::Pick a = router->Route(key, 0);
    ASSERT_NE(a.stub, nullptr);
    EXPECT_STREQ(a.route, PrefillRouter::kAffinity);
    EXPECT_EQ(router->Route(key, 0).node, a.node);  // the same node every time
    ++count[a.node];
  }
  ASSERT_EQ(count.size(), 3u);
  for (const auto& [node, n] : count) EXPECT_GT(n, 600 / 3 / 2) << node;  // none starved
  // Only the first key_tokens tokens count: prompts that share them share the node.
  std::vector<int32_t> longer = Prompt(7, 20), other = Prompt(7, 4);
  longer[10] = 99;
  EXPECT_EQ(router->Key(longer), router->Key(other));
  EXPECT_NE(router->Key(Prompt(7, 20)), router->Key(Prompt(8, 20)));
}

TEST(PrefillRouter, RetriesGoToTheLeastLoadedOtherNodeThenBack) {
  Nodes nodes(3);
  auto router = MakeRouter(nodes.target());
  ASSERT_NE(router, nullptr);
  const uint64_t key = router->Key(Prompt(1, 8));
  PrefillRouter::Pick preferred = router->Route(key, 0);
  // Load one other node with two calls: a retry then goes to the third.
  PrefillRouter::Pick first_retry = router->Route(key, 1);
  EXPECT_STREQ(first_retry.route, PrefillRouter::kFallback);
  EXPECT_NE(first_retry.node, preferred.node);
  PrefillRouter::Pick again = router->Route(key, 1);
  EXPECT_NE(again.node, first_retry.node);  // first_retry's node has one in flight now
  EXPECT_NE(again.node, preferred.node);
  PrefillRouter::Pick more = router->Route(key, 1);  // both others carry one: ring order
  std::map<std::string, int> load = router->load();
  EXPECT_EQ(load[preferred.node], 1);
  EXPECT_EQ(load[first_retry.node] + load[again.node], 3);
  // After the two least loaded others, a retry comes back to the preferred node.
  PrefillRouter::Pick third = router->Route(key, 3);
  EXPECT_EQ(third.node, preferred.node);
  EXPECT_STREQ(third.route, PrefillRouter::kAffinity);
  // Released picks leave no load behind.
  for (PrefillRouter::Pick* pick : {&preferred, &first_retry, &again, &more, &third}) *pick = {};
  for (const auto& [node, n] : router->load()) EXPECT_EQ(n, 0) << node;
}

TEST(PrefillRouter, AFailingNodesKeysGoElsewhereAtOnce) {
  Nodes nodes(2);
  auto router = MakeRouter(nodes.target());
  ASSERT_NE(router, nullptr);
  const uint64_t key = router->Key(Prompt(3, 8));
  const std::string preferred = router->Route(key, 0).node;
  nodes.Shutdown(preferred);
  // The channel notices the refused connection within its first reconnect; bounded here.
  PrefillRouter::Pick p;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  do {
    p = router->Route(key, 0);
    if (p.node != preferred) break;
    p = {};
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < until);
  EXPECT_NE(p.node, preferred);
  EXPECT_STREQ(p.route, PrefillRouter::kFallback);
}

TEST(PrefillRouter, RefusesTargetsItCannotRoute) {
  auto channel = [](const std::string& a) {
    return grpc::CreateChannel(a, grpc::InsecureChannelCredentials());
  };
  for (const char* bad : {"nocolon", "host:", ":50052", "dns:///a/b:1"}) {
    auto r = PrefillRouter::Create(bad, 4, channel);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(PrefillRouter::Create("ipv4:127.0.0.1:1", 0, channel).ok());
}

}  // namespace
}  // namespace kvwire
