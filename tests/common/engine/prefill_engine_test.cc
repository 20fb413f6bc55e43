// The prefill engine on its own: its stream reassembles into the cache a single-process
// prefill builds, it refuses bad jobs saying why, it stops between layers when its reader
// goes away or its deadline passes, and its queue is bounded.
#include "common/engine/prefill_engine.h"

#include <gtest/gtest.h>

#include <cstring>

#include "common/engine/generate.h"
#include "tests/engine_fakes.h"

namespace kvwire {
namespace {

using testing::FakeClock;

class PrefillEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::LoadModel("synthetic:tiny");
    ASSERT_NE(model_, nullptr);
  }
  PrefillJob Job(int len, const std::string& policy = "snapkv", int budget = 24) const {
    PrefillJob j;
    j.prompt_ids = {1};
    for (int i = 1; i < len; ++i) j.prompt_ids.push_back(3 + (i * 37) % 250);
    j.compression.policy = *MakePolicy(policy);
    j.compression.budget = budget;
    j.sampling.temperature = 0;
    return j;
  }
  std::unique_ptr<LlamaModel> model_;
};

// Counts what it is given; can cancel itself or move a clock at a chosen chunk.
class CountingSink final : public KvStreamSink {
 public:
  absl::Status OnHeader(const WireHeader& h) override {
    header = h;
    return absl::OkStatus();
  }
  absl::Status OnChunk(WireChunk c) override {
    if (chunks == cancel_at) cancel = true;
    if (chunks == advance_at) clock->Advance(std::chrono::seconds(10));
    ++chunks;
    return absl::OkStatus();
  }
  absl::Status OnTrailer(const WireTrailer& t) override {
    trailer = t;
    ++trailers;
    return absl::OkStatus();
  }
  bool cancelled() const override { return cancel; }

  WireHeader header;
  WireTrailer trailer;
  int chunks = 0, trailers = 0, cancel_at = -1, advance_at = -1;
  bool cancel = false;
  FakeClock* clock = nullptr;
};

TEST_F(PrefillEngineTest, StreamRebuildsTheCacheOfASingleProcessPrefill) {
  PrefillEngine engine(model_.get(), {.node_name = "p0", .workers = 0});
  const PrefillJob job = Job(90, "hbw", 40);
  const int len = 90;
  auto want = PrefillSequence(*model_, job.prompt_ids, job.compression, 0);
  ASSERT_TRUE(want.ok()) << want.status();
  auto cache = KvCache::Create(want->cache->shape(), HeapKvAllocator());
  ASSERT_TRUE(cache.ok());
  CacheStreamSink sink(StreamExpectation(*model_, job.compression, len, job.max_chunk_bytes),
                       cache->get(), model_->config().vocab_size);
  auto out = engine.Run(job, sink);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(sink.assembler().complete());
  EXPECT_EQ(out->trailer.node, "p0");
  EXPECT_EQ(out->trailer.first_token, want->first_token);
  EXPECT_EQ(out->logits, want->logits);
  EXPECT_EQ(testing::CacheDifference(*want->cache, **cache), "");
}

TEST_F(PrefillEngineTest, RefusesBadJobsSayingWhy) {
  PrefillEngine engine(model_.get(), {.node_name = "p0", .workers = 0});
  struct Case {
    std::function<void(PrefillJob*)> edit;
    absl::StatusCode code;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](auto* j) { j->model_fingerprint = "llama-other"; }, absl::StatusCode::kFailedPrecondition,
       "fingerprints differ"},
      {[](auto* j) { j->model_fingerprint = ""; }, absl::StatusCode::kFailedPrecondition,
       "fingerprints differ"},
      {[](auto* j) { j->prompt_ids.clear(); }, absl::StatusCode::kInvalidArgument, "empty"},
      {[](auto* j) { j->prompt_ids[2] = 100000; }, absl::StatusCode::kInvalidArgument,
       "prompt_ids[2] = 100000"},
      {[](auto* j) {
         j->compression.policy = *MakePolicy("rocketkv");
         j->compression.budget = 64;
       },
       absl::StatusCode::kInvalidArgument, "must be resolved"},
      {[](auto* j) { j->max_chunk_bytes = 10; }, absl::StatusCode::kInvalidArgument,
       "max_chunk_bytes"},
      {[](auto* j) { j->sampling.top_p = 2; }, absl::StatusCode::kInvalidArgument, "top_p"},
      {[](auto* j) { j->prompt_ids.resize(5000, 5); }, absl::StatusCode::kInvalidArgument,
       "context"},
  };
  for (const Case& c : cases) {
    PrefillJob job = Job(30);
    c.edit(&job);
    CountingSink sink;
    const absl::Status st = engine.Run(job, sink).status();
    EXPECT_EQ(st.code(), c.code) << c.expect << ": " << st;
    EXPECT_NE(std::string(st.message()).find(c.expect), std::string::npos) << st;
    // A caller is not told which model the node would accept (nor what it asked).
    EXPECT_EQ(std::string(st.message()).find(model_->fingerprint()), std::string::npos) << st;
    EXPECT_EQ(sink.chunks, 0) << "nothing streamed for a refused job";
  }
}

TEST_F(PrefillEngineTest, StopsBetweenLayersWhenCancelledOrLate) {
  FakeClock clock;
  PrefillEngine engine(model_.get(), {.node_name = "p0", .workers = 0, .clock = &clock});
  CountingSink cancelled;
  cancelled.cancel_at = 0;
  const absl::Status a = engine.Run(Job(60), cancelled).status();
  EXPECT_EQ(a.code(), absl::StatusCode::kCancelled) << a;
  EXPECT_EQ(cancelled.chunks, 1) << "the next layer never ran";
  EXPECT_EQ(cancelled.trailers, 0);

  PrefillJob late = Job(60);
  late.deadline = clock.Now() + std::chrono::seconds(5);
  CountingSink slow;
  slow.clock = &clock;
  slow.advance_at = 0;  // the first layer takes 10 s
  const absl::Status b = engine.Run(late, slow).status();
  EXPECT_EQ(b.code(), absl::StatusCode::kDeadlineExceeded) << b;
  EXPECT_NE(std::string(b.message()).find("at layer 1"), std::string::npos) << b;
  EXPECT_EQ(slow.trailers, 0);
}

// A sink that holds its stream at the header until released.
class HoldingSink final : public KvStreamSink {
 public:
  absl::Status OnHeader(const WireHeader&) override {
    std::unique_lock<std::mutex> lock(mu_);
    held_ = true;
    cv_.notify_all();
    cv_.wait_for(lock, testing::kWait, [&] { return released_; });
    return absl::OkStatus();
  }
  absl::Status OnChunk(WireChunk) override { return absl::OkStatus(); }
  absl::Status OnTrailer(const WireTrailer&) override { return absl::OkStatus(); }
  bool WaitHeld() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, testing::kWait, [&] { return held_; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false, released_ = false;
};

TEST_F(PrefillEngineTest, QueueIsBoundedAndShutdownFinishesWhatWaits) {
  PrefillEngine engine(model_.get(), {.node_name = "busy", .workers = 1, .max_queue = 1});
  std::mutex mu;
  std::condition_variable cv;
  std::vector<absl::Status> done;
  auto record = [&](const absl::Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    done.push_back(st);
    cv.notify_all();
  };
  auto running = std::make_shared<HoldingSink>();
  ASSERT_TRUE(engine.Submit(Job(30), running, record).ok());
  ASSERT_TRUE(running->WaitHeld());  // the worker is busy
  ASSERT_TRUE(engine.Submit(Job(30), std::make_shared<CountingSink>(), record).ok());  // queued
  const absl::Status full = engine.Submit(Job(30), std::make_shared<CountingSink>(), record);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(full.message()).find("prefill node busy is full"), std::string::npos)
      << full;
  std::thread stopper([&] { engine.Shutdown(); });
  {
    // The queued prefill ends UNAVAILABLE at once; the running one when released.
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, testing::kWait, [&] { return done.size() == 1; }));
    EXPECT_EQ(done[0].code(), absl::StatusCode::kUnavailable) << done[0];
  }
  running->Release();
  stopper.join();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_TRUE(done[1].ok()) << done[1];
  EXPECT_EQ(engine.Submit(Job(30), std::make_shared<CountingSink>(), record).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvwire
