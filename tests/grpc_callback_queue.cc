// Linked into the test executables that start gRPC servers and channels per test case.
//
// Debian's gRPC (1.51, whose iomgr does not poll in the background) serves the callback API
// of every server and channel of a process from one shared completion queue. Its threads
// start with the first server or channel that uses it, and the queue is torn down when the
// last one goes. A node keeps its servers and channels for its whole life, so that happens
// once, at exit. Tests start and stop them in each case, so it happens between cases and at
// each case's end, and that teardown races: CI saw a test executable abort after its case had
// passed ("assertion failed: prior > 0" in grpc_cq_internal_unref, on one of the queue's own
// threads), and the tracing tests, run in a loop two processes at a time, aborted so twice in
// about 750 runs, once between two cases. A channel that has made one callback-API call holds
// the queue for the executable's whole run: with it, the same loop ran 800 times without an
// abort. Released at the end, the channel still tore the queue down, and the same race
// aborted a case that makes no channel at all in about 6 runs in 800. So it is never released:
// the process ends with the queue up, and nothing tears it down.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace kvwire::testing {
namespace {

class CallbackQueueHolder : public ::testing::Environment {
 public:
  void SetUp() override {
    // Nothing listens on port 1, and the call's deadline is short: it ends at once, and
    // only its having been made matters (the channel's first callback call takes the queue).
    // What the call uses lives until its callback, even one that came after the wait below.
    struct Call {
      grpc::ClientContext ctx;
      grpc::ByteBuffer request, response;
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
    };
    auto call = std::make_shared<Call>();
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
    grpc::Slice empty("");
    call->request = grpc::ByteBuffer(&empty, 1);
    // Held past gtest's teardown of its environments, deliberately never freed (see above).
    static auto* const channel = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
    grpc::GenericStub stub(*channel);
    stub.UnaryCall(&call->ctx, "/kvwire.test.Nothing/Hold", grpc::StubOptions(), &call->request,
                   &call->response, [call](grpc::Status) {
                     std::lock_guard<std::mutex> lock(call->mu);
                     call->done = true;
                     call->cv.notify_one();
                   });
    std::unique_lock<std::mutex> lock(call->mu);
    ASSERT_TRUE(call->cv.wait_for(lock, std::chrono::seconds(30), [&] { return call->done; }))
        << "a call to a closed port with a 50 ms deadline did not end in 30 s";
  }
};

const ::testing::Environment* const kHolder =
    ::testing::AddGlobalTestEnvironment(new CallbackQueueHolder);

}  // namespace
}  // namespace kvwire::testing
