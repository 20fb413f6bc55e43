// Fakes of the engines' interfaces for tests that steer time and streams without a network
// or sleeps: a clock the test moves, a KvSource whose streams the test serves (from a real
// PrefillEngine) or breaks, a ResponseSink that records, and a PrefillExecutor wrapper that
// holds or corrupts a stream at a chosen chunk (for the gRPC nodes' tests).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/base/clock.h"
#include "common/engine/decode_engine.h"
#include "common/engine/generate.h"
#include "common/engine/kv_source.h"
#include "common/engine/prefill_engine.h"
#include "tests/test_util.h"

namespace kvwire::testing {

// Stores every layer it is given into one cache, as a receiving node's assembler would.
class CacheSink : public CompressedLayerSink {
 public:
  explicit CacheSink(KvCache* cache) : cache_(cache) {}
  absl::Status Accept(CompressedLayer layer) override { return StoreLayer(layer, cache_); }

 private:
  KvCache* cache_;
};

// Bounded waits of the tests: long enough never to matter on a loaded machine.
inline constexpr std::chrono::seconds kWait{20};

// A model for a test, on one CPU thread; null (and a test failure) when it cannot load.
inline std::unique_ptr<LlamaModel> LoadModel(const std::string& spec) {
  LoadOptions o;
  o.threads = 1;
  auto m = LlamaModel::Load(spec, o);
  EXPECT_TRUE(m.ok()) << spec << ": " << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// `n` greedy tokens after `prompt`, single-process; empty (and a test failure) on an error.
inline std::vector<int32_t> Greedy(LlamaModel& m, const std::vector<int32_t>& prompt, int n) {
  GenerationRequest req;
  req.prompt_ids = prompt;
  req.max_tokens = n;
  req.sampling.temperature = 0;
  auto r = Generate(m, req);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->ids : std::vector<int32_t>{};
}

// The teacher-forced negative log-likelihood of ids[1..] given the tokens before each, in
// nats, from one prefill with every position's logits.
inline double SumNll(LlamaModel& model, const std::vector<int32_t>& ids) {
  auto r = model.Prefill(ids, nullptr, /*all_logits=*/true);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return 0;
  const int vocab = model.config().vocab_size;
  double nll = 0;
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    const float* l = r->logits.data() + i * vocab;
    const float mx = *std::max_element(l, l + vocab);
    double z = 0;
    for (int v = 0; v < vocab; ++v) z += std::exp(static_cast<double>(l[v]) - mx);
    nll -= l[ids[i + 1]] - mx - std::log(z);
  }
  return nll;
}

// A passkey prompt as a single-process request: greedy, the answer's length, compressed
// by `policy` at `budget`.
inline GenerationRequest PasskeyRequest(const PasskeyCase& c, const std::string& policy = "full",
                                        int budget = 0) {
  GenerationRequest req;
  req.prompt_ids = c.prompt_ids;
  req.max_tokens = static_cast<int>(c.answer_ids.size());
  req.sampling.temperature = 0;
  auto p = MakePolicy(policy);
  EXPECT_TRUE(p.ok()) << p.status();
  if (p.ok()) req.compression.policy = *p;
  req.compression.budget = budget;
  return req;
}

// "" when two caches hold the same tokens (positions, K and V bytes) in every layer and
// head, else where they first differ.
inline std::string CacheDifference(const KvCache& want, const KvCache& got) {
  if (want.num_layers() != got.num_layers()) return "layer counts differ";
  for (int l = 0; l < want.num_layers(); ++l) {
    const LayerCache& a = want.layer(l);
    const LayerCache& b = got.layer(l);
    if (a.len != b.len || a.n_heads != b.n_heads || a.row_bytes() != b.row_bytes()) {
      return "layer " + std::to_string(l) + ": shapes differ";
    }
    for (int h = 0; h < a.n_heads; ++h) {
      for (int t = 0; t < a.len; ++t) {
        const std::string at = "layer " + std::to_string(l) + " head " + std::to_string(h) +
                               " slot " + std::to_string(t) + ": ";
        if (a.position(h, t) != b.position(h, t)) return at + "positions differ";
        if (std::memcmp(a.k_row(h, t), b.k_row(h, t), a.row_bytes()) != 0) return at + "K differs";
        if (std::memcmp(a.v_row(h, t), b.v_row(h, t), a.row_bytes()) != 0) return at + "V differs";
      }
    }
  }
  return "";
}

// "" when two caches keep the same positions in every layer and head and their K and V rows
// agree within `tol` (absolute, and relative to the larger magnitude), else where they first
// differ: a prefill that computed some rows in other batches (a prefix cache's) rounds them
// differently.
inline std::string CacheCloseness(const KvCache& want, const KvCache& got, float tol) {
  if (want.num_layers() != got.num_layers()) return "layer counts differ";
  for (int l = 0; l < want.num_layers(); ++l) {
    const LayerCache& a = want.layer(l);
    const LayerCache& b = got.layer(l);
    if (a.len != b.len || a.n_heads != b.n_heads || a.dtype != b.dtype ||
        a.head_dim != b.head_dim) {
      return "layer " + std::to_string(l) + ": shapes differ";
    }
    std::vector<float> x(a.head_dim), y(a.head_dim);
    for (int h = 0; h < a.n_heads; ++h) {
      for (int t = 0; t < a.len; ++t) {
        const std::string at = "layer " + std::to_string(l) + " head " + std::to_string(h) +
                               " slot " + std::to_string(t) + ": ";
        if (a.position(h, t) != b.position(h, t)) return at + "positions differ";
        for (int kv = 0; kv < 2; ++kv) {
          ToFloat(a.dtype, kv ? a.v_row(h, t) : a.k_row(h, t), x.data(), a.head_dim);
          ToFloat(b.dtype, kv ? b.v_row(h, t) : b.k_row(h, t), y.data(), b.head_dim);
          for (int i = 0; i < a.head_dim; ++i) {
            if (std::abs(x[i] - y[i]) >
                tol * std::max(1.f, std::max(std::abs(x[i]), std::abs(y[i])))) {
              return at + (kv ? "V" : "K") + " differs beyond the tolerance";
            }
          }
        }
      }
    }
  }
  return "";
}

class FakeClock final : public Clock {
 public:
  TimePoint Now() const override { return TimePoint(std::chrono::nanoseconds(ns_.load())); }
  void Advance(std::chrono::milliseconds d) { ns_ += std::chrono::nanoseconds(d).count(); }

 private:
  std::atomic<int64_t> ns_{std::chrono::nanoseconds(std::chrono::hours(1)).count()};
};

// A KvSource whose transfers wait for the test: each Start is recorded, and the test
// serves it from a PrefillEngine (on its own thread), fails it, or cuts it short.
class FakeKvSource final : public KvSource {
 public:
  class Transfer final : public KvTransfer {
   public:
    Transfer(PrefillJob job, std::shared_ptr<KvReceiver> receiver)
        : job_(std::move(job)), receiver_(std::move(receiver)) {}
    void Cancel() override {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      cv_.notify_all();
    }
    bool WaitCancelled() {
      std::unique_lock<std::mutex> lock(mu_);
      return cv_.wait_for(lock, kWait, [&] { return cancelled_; });
    }
    const PrefillJob& job() const { return job_; }
    KvReceiver& receiver() { return *receiver_; }

    // The whole stream, prefilled by `engine`; then OnDone. Stops after `max_chunks`
    // chunks (and ends with `cut`) when max_chunks >= 0.
    void Serve(PrefillEngine& engine, int max_chunks = -1,
               absl::Status cut = absl::UnavailableError("the prefill node died")) {
      class Cutting final : public KvStreamSink {
       public:
        Cutting(KvReceiver& r, int max, absl::Status cut) : r_(r), max_(max), cut_(cut) {}
        absl::Status OnHeader(const WireHeader& h) override { return r_.OnHeader(h); }
        absl::Status OnChunk(WireChunk c) override {
          if (max_ >= 0 && chunks_++ >= max_) return cut_;
          return r_.OnChunk(std::move(c));
        }
        absl::Status OnTrailer(const WireTrailer& t) override { return r_.OnTrailer(t); }
        int64_t transport_bytes() const override { return 1000; }

       private:
        KvReceiver& r_;
        int max_, chunks_ = 0;
        absl::Status cut_;
      } sink(*receiver_, max_chunks, cut);
      const absl::Status st = engine.Run(job_, sink).status();
      Done(st, sink.transport_bytes());
    }
    void Fail(const absl::Status& status) { Done(status, 0); }
    // Ends a stream the test left open (after a failed assertion), so the engine can stop.
    void FailIfOpen() {
      if (!done_.load()) Fail(absl::CancelledError("left open by the test"));
    }

   private:
    void Done(const absl::Status& status, int64_t bytes) {
      if (!done_.exchange(true)) receiver_->OnDone(status, bytes);
    }

    PrefillJob job_;
    std::shared_ptr<KvReceiver> receiver_;
    std::atomic<bool> done_{false};
    std::mutex mu_;
    std::condition_variable cv_;
    bool cancelled_ = false;
  };

  explicit FakeKvSource(std::string name = "fake") : name_(std::move(name)) {}
  absl::string_view name() const override { return name_; }
  // As a transport that writes into the receiver's cache would say (the engine then expects
  // placed chunks, and holds back pages such a transport may still write).
  KvPlacement placement() const override { return placement_; }
  void set_placement(KvPlacement p) { placement_ = p; }
  absl::StatusOr<std::shared_ptr<KvTransfer>> Start(PrefillJob job,
                                                    std::shared_ptr<KvReceiver> receiver) override {
    auto t = std::make_shared<Transfer>(std::move(job), std::move(receiver));
    std::lock_guard<std::mutex> lock(mu_);
    started_.push_back(t);
    all_.push_back(t);
    ++starts_;
    cv_.notify_all();
    return std::shared_ptr<KvTransfer>(t);
  }
  // The next transfer the engine started (in order), or null after kWait.
  std::shared_ptr<Transfer> Next() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, kWait, [&] { return !started_.empty(); })) return nullptr;
    auto t = started_.front();
    started_.pop_front();
    return t;
  }
  int starts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return starts_;
  }
  int pending() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(started_.size());
  }
  void FailOpenTransfers() {
    std::vector<std::shared_ptr<Transfer>> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      all = all_;
    }
    for (auto& t : all) t->FailIfOpen();
  }

 private:
  std::string name_;
  KvPlacement placement_ = KvPlacement::kNone;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Transfer>> started_;
  std::vector<std::shared_ptr<Transfer>> all_;
  int starts_ = 0;
};

// Records what the engine sends a client.
class RecordingSink final : public ResponseSink {
 public:
  bool Send(TokenDelta delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    ids.insert(ids.end(), delta.ids.begin(), delta.ids.end());
    text += delta.text;
    logprobs.insert(logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
    cv_.notify_all();
    return !cancelled_;
  }
  void Finish(const absl::Status& st, const RequestFigures* f) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++finishes;
    status = st;
    if (f) figures = *f;
    cv_.notify_all();
  }
  bool cancelled() const override { return cancelled_; }
  void Cancel() { cancelled_ = true; }

  // Blocks until Finish (bounded); false if it never came.
  bool finished() {
    std::lock_guard<std::mutex> lock(mu_);
    return finishes > 0;
  }
  bool WaitFinished() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return finishes > 0; });
  }
  // Blocks until at least n tokens arrived (bounded).
  bool WaitTokens(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return ids.size() >= n || finishes > 0; }) &&
           ids.size() >= n;
  }

  std::vector<int32_t> ids;
  std::string text;
  std::vector<float> logprobs;
  absl::Status status;
  RequestFigures figures;
  int finishes = 0;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> cancelled_{false};
};

// Wraps a PrefillExecutor to inject faults into its streams: hold a stream before its
// chunk `hold_chunk` until released (or until its reader goes away), and flip a payload
// byte of chunk `corrupt_chunk` after its checksum was computed.
class FaultyPrefills final : public PrefillExecutor {
 public:
  struct Plan {
    int hold_chunk = -1;     // streams stop before this chunk index
    int corrupt_chunk = -1;  // this chunk index arrives corrupted
  };
  FaultyPrefills(PrefillExecutor* inner, Plan plan) : inner_(inner), plan_(plan) {}
  ~FaultyPrefills() override { Release(); }

  absl::Status Submit(PrefillJob job, std::shared_ptr<KvStreamSink> sink, Done done) override {
    absl::Status st = inner_->Submit(std::move(job), std::make_shared<Sink>(this, std::move(sink)),
                                     std::move(done));
    // Counted once the inner executor has taken the job (queued or running), so a waiter
    // sees the queue as it is.
    if (st.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      ++submitted_;
      cv_.notify_all();
    }
    return st;
  }
  // Blocks until `n` streams have reached the hold point (bounded by kWait).
  bool WaitHeld(int n = 1) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return held_ >= n; });
  }
  // Blocks until the inner executor has accepted `n` prefills (bounded by kWait).
  bool WaitSubmitted(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return submitted_ >= n; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  class Sink final : public KvStreamSink {
   public:
    Sink(FaultyPrefills* owner, std::shared_ptr<KvStreamSink> inner)
        : owner_(owner), inner_(std::move(inner)) {}
    absl::Status OnHeader(const WireHeader& h) override { return inner_->OnHeader(h); }
    absl::Status OnChunk(WireChunk chunk) override {
      const int index = chunks_++;
      if (index == owner_->plan_.hold_chunk) owner_->Hold(*inner_);
      if (index == owner_->plan_.corrupt_chunk && !chunk.k.empty()) chunk.k[0] ^= 0x5a;
      return inner_->OnChunk(std::move(chunk));
    }
    absl::Status OnTrailer(const WireTrailer& t) override { return inner_->OnTrailer(t); }
    bool cancelled() const override { return inner_->cancelled(); }
    absl::string_view transport() const override { return inner_->transport(); }
    int64_t transport_bytes() const override { return inner_->transport_bytes(); }

   private:
    FaultyPrefills* owner_;
    std::shared_ptr<KvStreamSink> inner_;
    int chunks_ = 0;
  };

  // Waits for Release or for the stream's reader to go away (the sink exposes no event for
  // that, so it is checked every few milliseconds), within kWait.
  void Hold(const KvStreamSink& sink) {
    std::unique_lock<std::mutex> lock(mu_);
    ++held_;
    cv_.notify_all();
    const auto until = std::chrono::steady_clock::now() + kWait;
    while (!released_ && !sink.cancelled() && std::chrono::steady_clock::now() < until) {
      cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
  }

  PrefillExecutor* inner_;
  const Plan plan_;
  std::mutex mu_;
  std::condition_variable cv_;
  int held_ = 0, submitted_ = 0;
  bool released_ = false;
};

}  // namespace kvwire::testing
