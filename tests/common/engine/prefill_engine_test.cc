// The prefill engine on its own: its stream reassembles into the cache a single-process
// prefill builds, it refuses bad jobs saying why, it stops between layers when its reader
// goes away or its deadline passes, and its queue is bounded.
#include "common/engine/prefill_engine.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "common/engine/generate.h"
#include "tests/engine_fakes.h"

namespace kvwire {
namespace {

// Runs a closure at a time on a thread of its own that lives as long as it does (a fresh
// std::thread may get the id of one that ended, and the guarded backend keys its queues by id).
class OtherThread {
 public:
  OtherThread() : thread_([this] { Loop(); }) {}
  ~OtherThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Returns once `fn` has run there.
  void Run(std::function<void()> fn) {
    std::unique_lock<std::mutex> lock(mu_);
    task_ = std::move(fn);
    cv_.notify_all();
    cv_.wait(lock, [&] { return task_ == nullptr; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || task_ != nullptr; });
      if (task_ == nullptr) return;
      task_();
      task_ = nullptr;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> task_;
  bool stop_ = false;
  std::thread thread_;
};

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
  void ExpectWarmPrefixStreamsAsCold(LlamaModel& model);
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

// The prefix cache: a prompt that starts with the blocks an earlier prompt computed computes
// only the rest, and streams what a cold prefill streams (the compressor's window is always
// computed anew, so it scores every key as a cold prefill does). Questions after one document,
// the same prompt twice, and one that shares part of a block, for each policy family; on the
// CPU and on the guarded backend (the device path: blocks in the backend's memory).
TEST_F(PrefillEngineTest, AWarmPrefixStreamsWhatAColdPrefillDoes) {
  for (auto backend : {kernels::BackendKind::kCpu, kernels::BackendKind::kGuarded}) {
    SCOPED_TRACE(kernels::BackendName(backend));
    LoadOptions load;
    load.backend = backend;
    auto model = LlamaModel::Load("synthetic:tiny", load);
    ASSERT_TRUE(model.ok()) << model.status();
    ExpectWarmPrefixStreamsAsCold(**model);
  }
}

void PrefillEngineTest::ExpectWarmPrefixStreamsAsCold(LlamaModel& model) {
  LlamaModel* const model_ = &model;
  PrefillEngine cold(model_, {.node_name = "cold", .workers = 0});
  PrefillEngineOptions o;
  o.node_name = "warm";
  o.workers = 0;
  o.prefix_cache_bytes = size_t{16} << 20;
  o.prefix_block_tokens = 16;
  PrefillEngine warm(model_, o);
  ASSERT_NE(warm.prefix_cache(), nullptr);
  const std::vector<int32_t> document = Job(100).prompt_ids;
  // The warm prefills alternate between this thread and another, as a node's workers take
  // requests: on the guarded backend (a queue per thread, as a GPU's stream per thread) a block
  // one thread filled is read by the other, so a block published before its rows landed fails.
  OtherThread other;
  int warm_runs = 0;
  // The first prompt fills the cache; the others: another question, the same again, a longer.
  struct Case {
    std::vector<int32_t> question;
  };
  std::vector<Case> cases = {{{7, 8, 9, 10, 11, 12}},
                             {{20, 21, 22, 23}},
                             {{20, 21, 22, 23}},
                             {{30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44}}};
  for (const char* policy : {"snapkv", "full", "chunkkv", "hbw"}) {
    SCOPED_TRACE(policy);
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(i);
      PrefillJob job = Job(2, policy, 24);
      job.prompt_ids = document;
      job.prompt_ids.insert(job.prompt_ids.end(), cases[i].question.begin(),
                            cases[i].question.end());
      const int len = static_cast<int>(job.prompt_ids.size());
      auto run = [&](PrefillEngine& engine, std::unique_ptr<KvCache>* cache) {
        auto shape = PrefillSequence(*model_, job.prompt_ids, job.compression, 0);
        *cache = *KvCache::Create(shape->cache->shape(), HeapKvAllocator());
        CacheStreamSink sink(StreamExpectation(*model_, job.compression, len, job.max_chunk_bytes),
                             cache->get(), model_->config().vocab_size);
        absl::StatusOr<PrefillOutcome> out;
        if (&engine == &warm && warm_runs++ % 2 == 1) {
          other.Run([&] { out = engine.Run(job, sink); });
        } else {
          out = engine.Run(job, sink);
        }
        EXPECT_TRUE(out.ok()) << out.status();
        EXPECT_TRUE(sink.assembler().complete());
        return out.ok() ? *std::move(out) : PrefillOutcome{};
      };
      // What the prompts before left in the cache is used up to where the compressor's window
      // begins (its rows are computed anew).
      const int window = job.compression.NeedsScores() ? job.compression.window : 0;
      const int reusable = (len - std::max(1, window)) / 16 * 16;
      const int cached = std::min(warm.prefix_cache()->CachedTokens(job.prompt_ids), reusable);
      if (i > 0) {
        EXPECT_GE(cached, 80);
      }
      std::unique_ptr<KvCache> want, got;
      const PrefillOutcome a = run(cold, &want);
      const PrefillOutcome b = run(warm, &got);
      EXPECT_EQ(b.trailer.cached_tokens, cached);
      EXPECT_EQ(a.trailer.cached_tokens, 0);
      // The same kept positions and first token; the rows computed apart from the prefix's
      // round a little differently (their matrix products have other shapes).
      EXPECT_EQ(b.trailer.first_token, a.trailer.first_token);
      EXPECT_EQ(testing::CacheCloseness(*want, *got, 1e-4f), "");
      float most = 0;
      for (size_t v = 0; v < a.logits.size(); ++v) {
        most = std::max(most, std::abs(a.logits[v] - b.logits[v]));
      }
      EXPECT_LT(most, 1e-4f);
    }
  }
  // A question that shares only part of the document's last block: the whole blocks before it.
  PrefillJob job = Job(2, "snapkv", 24);
  job.prompt_ids.assign(document.begin(), document.begin() + 90);
  job.prompt_ids.insert(job.prompt_ids.end(), {5, 6, 7, 8, 9, 10, 11, 12, 13, 14});
  EXPECT_EQ(warm.prefix_cache()->CachedTokens(job.prompt_ids), 80);
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
