// The decode engine on its own: no network and no sleeps. Its KV comes from a FakeKvSource
// whose streams the test serves from a real PrefillEngine (or cuts short), its time from a
// FakeClock the test moves, and its clients are RecordingSinks. What it must do: admit in
// order within the batch, the queue and the KV pool; produce exactly the tokens of
// single-process generation; retry a stream that died on another attempt; and end every
// cancelled, timed-out or failed request cleanly, with its pool memory back.
#include "common/engine/decode_engine.h"

#include <gtest/gtest.h>

#include <optional>
#include <thread>

#include "common/engine/generate.h"
#include "tests/engine_fakes.h"

namespace kvwire {
namespace {

using testing::FakeClock;
using testing::FakeKvSource;
using testing::RecordingSink;

constexpr size_t kPool = 64 << 20;

class DecodeEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::LoadModel("synthetic:tiny");
    ASSERT_NE(model_, nullptr);
    PrefillEngineOptions p;
    p.node_name = "fake-prefill";
    p.workers = 0;      // the test serves streams on its own thread
    p.clock = &clock_;  // deadlines are points on the engine's clock, as GrpcKvSource sends them
    prefill_ = std::make_unique<PrefillEngine>(model_.get(), p);
  }
  void TearDown() override {
    remote_.FailOpenTransfers();  // streams a failed test left open
    local_.FailOpenTransfers();
    live_ = nullptr;
    engine_.reset();
    pool_.reset();
  }

  void Start(DecodeEngineOptions o = {}, size_t pool_bytes = kPool) {
    pool_ = std::make_unique<KvPool>(pool_bytes, 4096, [this] {
      if (DecodeEngine* e = live_.load()) e->Wake();
    });
    o.node_name = "decode-test";
    // Tests that are not about the backoff retry at once: the fake clock stands still.
    if (o.prefill_backoff_ms == DecodeEngineOptions{}.prefill_backoff_ms) o.prefill_backoff_ms = 0;
    o.remote = &remote_;
    o.clock = &clock_;
    engine_ = std::make_unique<DecodeEngine>(model_.get(), pool_.get(), o);
    live_ = engine_.get();
  }

  std::vector<int32_t> Prompt(int n, int salt = 0) const {
    std::vector<int32_t> ids = {1};
    for (int i = 1; i < n; ++i) ids.push_back(3 + (i * (13 + salt)) % 250);
    return ids;
  }

  GenerationJob Job(int prompt_len, int max_tokens, int salt = 0) const {
    GenerationJob j;
    j.request_id = "r" + std::to_string(salt);
    j.prompt_ids = Prompt(prompt_len, salt);
    j.max_tokens = max_tokens;
    j.sampling.temperature = 0;
    j.compression.policy = *MakePolicy("snapkv");
    j.compression.budget = 24;
    j.logprobs = true;
    return j;
  }

  // What single-process generation gives for the same request.
  GenerationResult Reference(const GenerationJob& j) const {
    GenerationRequest r;
    r.prompt_ids = j.prompt_ids;
    r.max_tokens = j.max_tokens;
    r.sampling = j.sampling;
    r.seed = j.seed;
    r.compression = j.compression;
    r.attention = j.attention;
    r.stop_ids = j.stop_ids;
    auto out = Generate(*model_, r);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : GenerationResult{};
  }

  std::shared_ptr<RecordingSink> Submit(GenerationJob j) {
    auto sink = std::make_shared<RecordingSink>();
    EXPECT_TRUE(engine_->Submit(std::move(j), sink).ok());
    return sink;
  }

  // Submits a job and takes the transfer the engine starts for it (null after kWait).
  std::shared_ptr<FakeKvSource::Transfer> SubmitAndStart(GenerationJob j,
                                                         std::shared_ptr<RecordingSink>* sink,
                                                         FakeKvSource* source = nullptr) {
    *sink = Submit(std::move(j));
    return (source ? source : &remote_)->Next();
  }

  // Every request done and every byte of the pool back.
  void ExpectIdle() {
    EXPECT_EQ(engine_->active(), 0);
    EXPECT_EQ(engine_->queued(), 0);
    EXPECT_EQ(pool_->used(), 0u);
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<PrefillEngine> prefill_;
  FakeClock clock_;
  FakeKvSource remote_{"grpc"};
  FakeKvSource local_{"local"};
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<DecodeEngine> engine_;
  std::atomic<DecodeEngine*> live_{nullptr};  // what the pool's callback wakes
};

TEST_F(DecodeEngineTest, BatchedRequestsEqualSingleProcessGeneration) {
  DecodeEngineOptions o;
  o.max_batch = 4;
  Start(o);
  std::vector<GenerationJob> jobs;
  std::vector<std::shared_ptr<RecordingSink>> sinks;
  for (int i = 0; i < 4; ++i) {
    jobs.push_back(Job(40 + 9 * i, 6 + i, i));
    sinks.push_back(Submit(jobs.back()));
  }
  // All four are admitted together; their streams arrive in any order.
  std::vector<std::shared_ptr<FakeKvSource::Transfer>> transfers;
  for (int i = 0; i < 4; ++i) transfers.push_back(remote_.Next());
  for (int i : {2, 0, 3, 1}) {
    ASSERT_NE(transfers[i], nullptr);
    EXPECT_EQ(transfers[i]->job().compression.Describe(), jobs[i].compression.Describe());
    EXPECT_EQ(transfers[i]->job().model_fingerprint, model_->fingerprint());
    transfers[i]->Serve(*prefill_);
  }
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(sinks[i]->WaitFinished());
    ASSERT_TRUE(sinks[i]->status.ok()) << sinks[i]->status;
    const GenerationResult want = Reference(jobs[i]);
    EXPECT_EQ(sinks[i]->ids, want.ids);
    ASSERT_EQ(sinks[i]->logprobs.size(), want.logprobs.size());
    for (size_t t = 0; t < want.logprobs.size(); ++t) {
      EXPECT_NEAR(sinks[i]->logprobs[t], want.logprobs[t], 1e-4);
    }
    const RequestFigures& f = sinks[i]->figures;
    EXPECT_EQ(f.prompt_tokens, static_cast<int>(jobs[i].prompt_ids.size()));
    EXPECT_EQ(f.completion_tokens, static_cast<int>(want.ids.size()));
    EXPECT_EQ(f.kept_tokens, 24);
    EXPECT_EQ(f.wire_bytes, 1000);  // what the fake transport reported
    EXPECT_EQ(f.prefill_node, "fake-prefill");
    EXPECT_EQ(f.decode_node, "decode-test");
    EXPECT_EQ(f.prefill_attempts, 1);
    EXPECT_EQ(sinks[i]->finishes, 1);
  }
  ExpectIdle();
}

TEST_F(DecodeEngineTest, AdmitsNoMoreThanTheBatchAndRefusesBeyondTheQueue) {
  DecodeEngineOptions o;
  o.max_batch = 1;
  o.max_queue = 1;
  Start(o);
  auto first = Submit(Job(30, 3, 1));
  auto t1 = remote_.Next();  // admitted: the batch is full
  ASSERT_NE(t1, nullptr);
  auto second = Submit(Job(30, 3, 2));  // waits for the batch
  auto refused = std::make_shared<RecordingSink>();
  const absl::Status st = engine_->Submit(Job(30, 3, 3), refused);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(std::string(st.message()).find("decode node decode-test is full"), std::string::npos)
      << st;
  EXPECT_EQ(remote_.starts(), 1);
  t1->Serve(*prefill_);
  ASSERT_TRUE(first->WaitFinished());
  EXPECT_TRUE(first->status.ok()) << first->status;
  auto t2 = remote_.Next();  // the second goes in once the first left the batch
  ASSERT_NE(t2, nullptr);
  t2->Serve(*prefill_);
  ASSERT_TRUE(second->WaitFinished());
  EXPECT_TRUE(second->status.ok()) << second->status;
  EXPECT_EQ(refused->finishes, 0);
  ExpectIdle();
}

TEST_F(DecodeEngineTest, FullPoolWaitsForRoomThenTimesOut) {
  DecodeEngineOptions o;
  o.queue_timeout_ms = 500;
  const GenerationJob job = Job(60, 40, 1);
  const size_t one = KvCache::BytesFor(
      CompressedCacheShape(job.compression, model_->config(), model_->kv_dtype(), 60, 40));
  Start(o, one + one / 2);  // room for one request at a time
  std::shared_ptr<RecordingSink> first;
  auto t1 = SubmitAndStart(job, &first);
  ASSERT_NE(t1, nullptr);
  auto second = Submit(Job(60, 40, 2));
  auto third = Submit(Job(60, 40, 3));
  // The second waits; once the first is done its memory admits the second.
  t1->Serve(*prefill_);
  ASSERT_TRUE(first->WaitFinished());
  auto t2 = remote_.Next();
  ASSERT_NE(t2, nullptr);
  EXPECT_EQ(t2->job().request_id, "r2");
  // The third waits behind it until the queue timeout passes on the engine's clock.
  clock_.Advance(std::chrono::milliseconds(501));
  engine_->Wake();
  ASSERT_TRUE(third->WaitFinished());
  EXPECT_EQ(third->status.code(), absl::StatusCode::kResourceExhausted) << third->status;
  EXPECT_NE(std::string(third->status.message()).find("waited 500 ms"), std::string::npos)
      << third->status;
  t2->Serve(*prefill_);
  ASSERT_TRUE(second->WaitFinished());
  EXPECT_TRUE(second->status.ok()) << second->status;
  // A request the pool could never hold is refused at once, saying why.
  auto huge = Submit(Job(60, 3000, 4));
  ASSERT_TRUE(huge->WaitFinished());
  EXPECT_EQ(huge->status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(huge->status.message()).find("pool holds"), std::string::npos);
  ExpectIdle();
}

TEST_F(DecodeEngineTest, CancellationDuringPrefillCancelsTheStream) {
  Start();
  std::shared_ptr<RecordingSink> sink;
  auto t = SubmitAndStart(Job(50, 8, 1), &sink);
  ASSERT_NE(t, nullptr);
  sink->Cancel();
  engine_->Wake();
  ASSERT_TRUE(t->WaitCancelled()) << "the engine cancels the transfer";
  t->Fail(absl::CancelledError("cancelled by the decode node"));
  ASSERT_TRUE(sink->WaitFinished());
  EXPECT_EQ(sink->status.code(), absl::StatusCode::kCancelled) << sink->status;
  EXPECT_EQ(remote_.starts(), 1) << "a cancelled request is not retried";
  ExpectIdle();
}

// cuda_ipc: a prefill node writes the rows into the cache's pages itself, so pages of an attempt
// that did not end with its whole stream (it may still be writing) stay out of the pool until
// the attempt's deadline, the node's lease, and a second more have passed; an attempt the node
// refused before any header returns them at once.
TEST_F(DecodeEngineTest, PagesAPrefillNodeMayStillWriteWaitOutItsLease) {
  remote_.set_placement(KvPlacement::kRows);
  DecodeEngineOptions o;
  o.prefill_attempts = 1;
  o.prefill_attempt_timeout_ms = 5000;
  Start(o);
  std::shared_ptr<RecordingSink> sink;
  auto t = SubmitAndStart(Job(50, 8, 1), &sink);
  ASSERT_NE(t, nullptr);
  t->Serve(*prefill_, /*max_chunks=*/0);  // the header, then the node dies
  ASSERT_TRUE(sink->WaitFinished());
  EXPECT_EQ(sink->status.code(), absl::StatusCode::kUnavailable) << sink->status;
  EXPECT_EQ(engine_->active(), 0);
  const size_t held = pool_->used();
  EXPECT_GT(held, 0u) << "the pages wait out the lease";
  auto pool_back = [&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (pool_->used() != 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return pool_->used() == 0;
  };
  clock_.Advance(std::chrono::milliseconds(5500));  // past the deadline, within the second
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(pool_->used(), held);
  clock_.Advance(std::chrono::milliseconds(600));
  EXPECT_TRUE(pool_back()) << pool_->used() << " bytes still held after the lease";

  // Refused before a header (a node that does not serve the transport): nothing was written.
  t = SubmitAndStart(Job(50, 8, 2), &sink);
  ASSERT_NE(t, nullptr);
  t->Fail(absl::FailedPreconditionError("this prefill node does not serve cuda_ipc"));
  ASSERT_TRUE(sink->WaitFinished());
  EXPECT_EQ(sink->status.code(), absl::StatusCode::kFailedPrecondition) << sink->status;
  ExpectIdle();
}

TEST_F(DecodeEngineTest, CancellationWhileDecodingEndsTheSequence) {
  Start();
  GenerationJob j = Job(50, 2000, 1);
  j.compression.budget = 0;
  j.compression.policy = FullPolicy();
  std::shared_ptr<RecordingSink> sink;
  auto t = SubmitAndStart(j, &sink);
  ASSERT_NE(t, nullptr);
  t->Serve(*prefill_);
  ASSERT_TRUE(sink->WaitTokens(3));
  sink->Cancel();
  engine_->Wake();
  ASSERT_TRUE(sink->WaitFinished());
  EXPECT_EQ(sink->status.code(), absl::StatusCode::kCancelled) << sink->status;
  EXPECT_LT(sink->ids.size(), 2000u);
  ExpectIdle();
}

TEST_F(DecodeEngineTest, DeadlinesWhileQueuedAndDuringPrefill) {
  DecodeEngineOptions o;
  o.max_batch = 1;
  Start(o);
  GenerationJob a = Job(50, 4, 1), b = Job(50, 4, 2);
  a.deadline = clock_.Now() + std::chrono::seconds(5);
  b.deadline = clock_.Now() + std::chrono::seconds(1);
  std::shared_ptr<RecordingSink> first;
  auto t = SubmitAndStart(a, &first);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->job().deadline, a.deadline) << "the stream carries the request's deadline";
  auto second = Submit(b);  // queued behind the full batch
  clock_.Advance(std::chrono::milliseconds(1500));
  engine_->Wake();
  ASSERT_TRUE(second->WaitFinished());
  EXPECT_EQ(second->status.code(), absl::StatusCode::kDeadlineExceeded) << second->status;
  EXPECT_NE(std::string(second->status.message()).find("while queued"), std::string::npos);
  clock_.Advance(std::chrono::seconds(4));
  engine_->Wake();
  ASSERT_TRUE(t->WaitCancelled()) << "the engine cancels a stream past its deadline";
  t->Fail(absl::CancelledError("cancelled"));
  ASSERT_TRUE(first->WaitFinished());
  EXPECT_EQ(first->status.code(), absl::StatusCode::kDeadlineExceeded) << first->status;
  EXPECT_NE(std::string(first->status.message()).find("during prefill"), std::string::npos);
  ExpectIdle();
}

TEST_F(DecodeEngineTest, ASourceThatDiesMidStreamIsRetried) {
  Start();
  const GenerationJob job = Job(70, 6, 1);
  std::shared_ptr<RecordingSink> sink;
  auto dying = SubmitAndStart(job, &sink);
  ASSERT_NE(dying, nullptr);
  dying->Serve(*prefill_, /*max_chunks=*/1);  // one layer arrives, then the node is gone
  auto retry = remote_.Next();
  ASSERT_NE(retry, nullptr) << "a second attempt starts";
  retry->Serve(*prefill_);
  ASSERT_TRUE(sink->WaitFinished());
  ASSERT_TRUE(sink->status.ok()) << sink->status;
  EXPECT_EQ(sink->ids, Reference(job).ids) << "the cache of the failed attempt is not reused";
  EXPECT_EQ(sink->figures.prefill_attempts, 2);
  EXPECT_EQ(sink->figures.wire_bytes, 2000) << "both attempts' bytes count";
  ExpectIdle();
}

// Moves the engine's clock in `step`s until `done` holds (each step gives the engine a
// turn); the fake time that took, or nullopt if it did not happen within `limit`.
template <typename Pred>
std::optional<std::chrono::milliseconds> AdvanceUntil(testing::FakeClock& clock,
                                                      DecodeEngine& engine, Pred done,
                                                      std::chrono::milliseconds step,
                                                      std::chrono::milliseconds limit) {
  for (std::chrono::milliseconds t{0}; t <= limit; t += step) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
    while (std::chrono::steady_clock::now() < until) {
      if (done()) return t;
      std::this_thread::yield();
    }
    clock.Advance(step);
    engine.Wake();
  }
  return std::nullopt;
}

// A full prefill tier (every node's queue full) is not a failed attempt: the request waits,
// retrying after a jittered backoff on the engine's clock, and goes in when a node has room.
TEST_F(DecodeEngineTest, AFullPrefillTierIsWaitedForWithBackoff) {
  DecodeEngineOptions o;
  o.prefill_attempts = 1;
  o.prefill_backoff_ms = 100;  // retries within [0, 200) ms, then [0, 400) ms, ...
  o.prefill_wait_ms = 60000;
  Start(o);
  const GenerationJob job = Job(70, 6, 1);
  std::shared_ptr<RecordingSink> sink;
  auto t = SubmitAndStart(job, &sink);
  ASSERT_NE(t, nullptr);
  for (int refusal = 0; refusal < 3; ++refusal) {
    t->Fail(absl::ResourceExhaustedError("prefill node p0 is full"));
    const auto waited = AdvanceUntil(
        clock_, *engine_, [&] { return remote_.pending() > 0; }, std::chrono::milliseconds(10),
        std::chrono::milliseconds(2000));
    ASSERT_TRUE(waited.has_value()) << "retry " << refusal + 1;
    // Below the backoff's bound, give or take the steps the engine took to see the refusal.
    EXPECT_LT(*waited, std::chrono::milliseconds((200 << refusal) + 200));
    t = remote_.Next();
  }
  t->Serve(*prefill_);
  ASSERT_TRUE(sink->WaitFinished());
  ASSERT_TRUE(sink->status.ok()) << sink->status;
  EXPECT_EQ(sink->ids, Reference(job).ids);
  EXPECT_EQ(sink->figures.prefill_attempts, 1) << "refusals of a full node are not attempts";
  ExpectIdle();
}

// The wait for a node with room, or any reachable node, is bounded by --prefill-wait-ms,
// and the error says which tier was the problem.
TEST_F(DecodeEngineTest, TheWaitForAPrefillNodeIsBoundedAndSaysWhy) {
  DecodeEngineOptions o;
  o.prefill_backoff_ms = 10;
  o.prefill_wait_ms = 1000;
  Start(o);
  for (const auto& [refusal, expect] :
       {std::pair<absl::Status, std::string>{absl::ResourceExhaustedError("node full"),
                                             "the prefill tier is full"},
        {absl::UnavailableError("connection refused"), "no prefill node could be reached"}}) {
    auto sink = Submit(Job(70, 6, 1));
    std::chrono::milliseconds total{0};
    for (int i = 0; !sink->finished(); ++i) {
      ASSERT_LT(i, 500) << "still trying";
      auto t = remote_.Next();
      ASSERT_NE(t, nullptr) << "try " << i;
      t->Fail(refusal);  // before any stream header: no node took it
      const auto waited = AdvanceUntil(
          clock_, *engine_, [&] { return remote_.pending() > 0 || sink->finished(); },
          std::chrono::milliseconds(10), std::chrono::milliseconds(2000));
      ASSERT_TRUE(waited.has_value());
      total += *waited;
    }
    EXPECT_GE(total, std::chrono::milliseconds(900)) << "it waited about --prefill-wait-ms";
    EXPECT_LE(total, std::chrono::milliseconds(1500));
    EXPECT_EQ(sink->status.code(), refusal.code()) << sink->status;
    EXPECT_NE(std::string(sink->status.message()).find(expect), std::string::npos) << sink->status;
    EXPECT_NE(std::string(sink->status.message()).find("--prefill-wait-ms"), std::string::npos);
  }
  ExpectIdle();
}

TEST_F(DecodeEngineTest, AttemptsRunOutAndMalformedStreamsFail) {
  DecodeEngineOptions o;
  o.prefill_attempts = 2;
  Start(o);
  auto sink = Submit(Job(70, 6, 1));
  for (int i = 0; i < 2; ++i) {
    auto t = remote_.Next();
    ASSERT_NE(t, nullptr);
    t->Serve(*prefill_, /*max_chunks=*/0);
  }
  ASSERT_TRUE(sink->WaitFinished());
  EXPECT_EQ(sink->status.code(), absl::StatusCode::kUnavailable) << sink->status;
  EXPECT_NE(std::string(sink->status.message()).find("prefill (2 attempts)"), std::string::npos)
      << sink->status;
  // A stream that breaks the wire format is the prefill node's fault, not the client's:
  // INTERNAL, never INVALID_ARGUMENT, and not retried forever.
  auto bad = Submit(Job(70, 6, 2));
  for (int i = 0; i < 2; ++i) {
    auto t = remote_.Next();
    ASSERT_NE(t, nullptr);
    WireHeader h = StreamHeader(*model_, t->job().compression, 70);
    h.num_layers += 1;
    const absl::Status st = t->receiver().OnHeader(h);
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
    t->Fail(st);
  }
  ASSERT_TRUE(bad->WaitFinished());
  EXPECT_EQ(bad->status.code(), absl::StatusCode::kInternal) << bad->status;
  EXPECT_NE(std::string(bad->status.message()).find("from the prefill node"), std::string::npos);
  ExpectIdle();
}

TEST_F(DecodeEngineTest, ShortPromptsPrefillLocally) {
  FakeKvSource& local = local_;
  DecodeEngineOptions o;
  o.local = &local;
  o.local_prefill_below = 20;
  Start(o);
  auto short_one = Submit(Job(10, 3, 1));
  auto t = local.Next();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(remote_.starts(), 0);
  t->Serve(*prefill_, /*max_chunks=*/0);  // a local prefill that fails is not retried
  ASSERT_TRUE(short_one->WaitFinished());
  EXPECT_EQ(short_one->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(local.starts(), 1);
  std::shared_ptr<RecordingSink> long_one;
  auto r = SubmitAndStart(Job(40, 3, 2), &long_one);
  ASSERT_NE(r, nullptr);
  r->Serve(*prefill_);
  ASSERT_TRUE(long_one->WaitFinished());
  EXPECT_TRUE(long_one->status.ok());
  EXPECT_EQ(local.starts(), 1);
  ExpectIdle();
}

TEST_F(DecodeEngineTest, StopTokensAndDrain) {
  Start();
  GenerationJob j = Job(50, 20, 1);
  const GenerationResult full = Reference(j);
  ASSERT_GE(full.ids.size(), 4u);
  j.stop_ids = {full.ids[3]};
  std::shared_ptr<RecordingSink> sink;
  auto t = SubmitAndStart(j, &sink);
  ASSERT_NE(t, nullptr);
  t->Serve(*prefill_);
  ASSERT_TRUE(sink->WaitFinished());
  ASSERT_TRUE(sink->status.ok());
  const auto stop_at = std::find(full.ids.begin(), full.ids.end(), full.ids[3]) + 1;
  EXPECT_EQ(sink->ids, std::vector<int32_t>(full.ids.begin(), stop_at));
  EXPECT_EQ(sink->figures.finish, FinishReason::kStop);
  // Draining refuses new work and ends queued requests as UNAVAILABLE.
  engine_->Drain(std::chrono::milliseconds(0));
  auto late = std::make_shared<RecordingSink>();
  EXPECT_EQ(engine_->Submit(Job(50, 2, 9), late).code(), absl::StatusCode::kUnavailable);
  ExpectIdle();
}

TEST_F(DecodeEngineTest, DrainWaitsForTheRunningOnesToFinish) {
  Start();
  std::shared_ptr<RecordingSink> sink;
  auto t = SubmitAndStart(Job(40, 30, 1), &sink);
  ASSERT_NE(t, nullptr);
  t->Serve(*prefill_);
  ASSERT_TRUE(sink->WaitTokens(1));
  engine_->Drain(std::chrono::seconds(20));
  // Drain returns once the client has heard the end, not merely once the batch is empty.
  EXPECT_EQ(sink->finishes, 1);
  EXPECT_TRUE(sink->status.ok()) << sink->status;
  EXPECT_EQ(sink->ids.size(), 30u);
  ExpectIdle();
}

}  // namespace
}  // namespace kvwire
