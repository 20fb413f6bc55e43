// A server-streaming reactor fed from any thread. gRPC reactions must not block, and the
// engines that produce messages run on their own threads, so producers push into a
// queue (Send) and the reactor writes one message at a time from it; Finish is deferred
// until the queue drains. Producers keep a shared_ptr to the StreamState, which outlives
// the reactor: after the RPC is done, Send and Finish are no-ops.
//
// Coalescing: SendFoldable lets a producer that runs ahead of the writer fold new content
// into the last queued message while that one still waits, so a reader that is behind gets
// fewer, larger messages instead of a queue that grows (vLLM's output collector does the same
// with a request's outputs its consumer has not taken yet). It never delays a message: what
// the writer can take at once is written at once.
//
// Backpressure: WaitForRoom blocks a producer (never a gRPC thread) while too many
// messages are queued, so a slow client cannot make a node buffer a whole KV cache, and
// for a bounded time only: a reader that takes nothing for that long has its call
// cancelled, so that a stream nobody reads cannot hold the producer's thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include "common/server/tsan.h"

namespace kvwire {

template <typename Msg>
class StreamState;

template <typename Msg>
class BufferedWriteReactor final : public grpc::ServerWriteReactor<Msg> {
 public:
  explicit BufferedWriteReactor(std::shared_ptr<StreamState<Msg>> state)
      : state_(std::move(state)) {
    HandOffToGrpc(this);  // the handler returns the reactor to gRPC
  }
  void OnWriteDone(bool ok) override {
    TakeBackFromGrpc(this);
    state_->OnWriteDone(ok);
  }
  void OnCancel() override {
    TakeBackFromGrpc(this);
    state_->OnCancel();
  }
  void OnDone() override {
    TakeBackFromGrpc(this);
    state_->OnDone();
    delete this;
  }

 private:
  std::shared_ptr<StreamState<Msg>> state_;
};

template <typename Msg>
class StreamState : public std::enable_shared_from_this<StreamState<Msg>> {
 public:
  // Makes the reactor that gRPC owns for the call of `ctx`; `on_cancel` runs (on a gRPC
  // thread, so it must not block) when the client cancels or the deadline passes.
  static std::pair<std::shared_ptr<StreamState>, grpc::ServerWriteReactor<Msg>*> Create(
      grpc::CallbackServerContext* ctx, std::function<void()> on_cancel = {}) {
    auto state = std::shared_ptr<StreamState>(new StreamState(ctx, std::move(on_cancel)));
    auto* reactor = new BufferedWriteReactor<Msg>(state);
    state->reactor_ = reactor;
    return {state, reactor};
  }

  // Queues a message; false once the stream is finishing, cancelled or done.
  bool Send(Msg msg) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_ || done_ || cancelled_) return false;
    queue_.push_back(std::move(msg));
    last_foldable_ = false;
    if (!writing_) StartNextLocked();
    return true;
  }

  // Queues `make()`, or, while the last queued message came from SendFoldable too and still
  // waits behind the write in progress, calls `fold(&that_message)` instead (true: folded;
  // false: it refused, and `make()` is queued after it). Both run under the stream's lock,
  // so they must be quick and must not call back into the stream.
  template <typename Make, typename Fold>
  bool SendFoldable(Make&& make, Fold&& fold) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_ || done_ || cancelled_) return false;
    if (writing_ && queue_.size() >= 2 && last_foldable_ && fold(&queue_.back())) return true;
    queue_.push_back(make());
    last_foldable_ = true;
    if (!writing_) StartNextLocked();
    return true;
  }

  // Finishes once every queued message is written (immediately if cancelled).
  void Finish(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_ || done_) return;
    finishing_ = true;
    status_ = status;
    // After a cancel nothing more is sent; the message being written stays until its
    // OnWriteDone (gRPC may still read it).
    if (cancelled_)
      queue_.erase(writing_ && !queue_.empty() ? queue_.begin() + 1 : queue_.begin(), queue_.end());
    if (!writing_) FinishLocked();
  }

  enum class Room { kReady, kEnded, kStalled };
  // Blocks while more than `max_queued` messages wait. kEnded if the stream ended; kStalled
  // if the reader took no message for `stall`, and then the call is cancelled.
  Room WaitForRoom(size_t max_queued, std::chrono::milliseconds stall) {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t seen = writes_done_;
    auto since = std::chrono::steady_clock::now();
    for (;;) {
      if (cancelled_ || done_) return Room::kEnded;
      if (queue_.size() <= max_queued) return Room::kReady;
      if (writes_done_ != seen) {  // progress: the stall clock starts again
        seen = writes_done_;
        since = std::chrono::steady_clock::now();
      }
      if (room_.wait_until(lock, since + stall) == std::cv_status::timeout &&
          writes_done_ == seen && !cancelled_ && !done_ && queue_.size() > max_queued) {
        break;
      }
    }
    // TryCancel outside the lock (its reactions take it); OnDone, which ends the context,
    // waits until it returned.
    cancelling_ = true;
    lock.unlock();
    ctx_->TryCancel();
    lock.lock();
    cancelling_ = false;
    room_.notify_all();
    return Room::kStalled;
  }

  bool cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_ || done_;
  }

  // gRPC callbacks (through the reactor).
  void OnWriteDone(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!queue_.empty()) queue_.pop_front();
    ++writes_done_;
    if (!ok) {  // the client went away
      cancelled_ = true;
      queue_.clear();
    }
    room_.notify_all();
    if (!queue_.empty() && !cancelled_) {
      StartNextLocked();
    } else if (finishing_ || cancelled_) {
      if (!finishing_) {
        finishing_ = true;
        status_ = grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
      FinishLocked();
    }
  }
  void OnCancel() {
    std::function<void()> cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      room_.notify_all();
      cb = on_cancel_;
      // gRPC still needs a Finish; give it now unless a write will complete and do it.
      if (!writing_ && !finishing_) {
        finishing_ = true;
        status_ = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
        queue_.clear();
        FinishLocked();
      }
    }
    if (cb) cb();
  }
  void OnDone() {
    std::unique_lock<std::mutex> lock(mu_);
    room_.wait(lock, [&] { return !cancelling_; });  // at most one TryCancel call long
    done_ = true;
    reactor_ = nullptr;
    room_.notify_all();
  }

 private:
  StreamState(grpc::CallbackServerContext* ctx, std::function<void()> on_cancel)
      : ctx_(ctx), on_cancel_(std::move(on_cancel)) {}

  void StartNextLocked() {
    writing_ = true;
    HandOffToGrpc(reactor_);
    reactor_->StartWrite(&queue_.front());
  }
  void FinishLocked() {
    if (finished_called_ || reactor_ == nullptr) return;
    finished_called_ = true;
    HandOffToGrpc(reactor_);
    reactor_->Finish(status_);
  }

  mutable std::mutex mu_;
  std::condition_variable room_;
  std::deque<Msg> queue_;  // front() is being written while writing_
  grpc::ServerWriteReactor<Msg>* reactor_ = nullptr;
  grpc::CallbackServerContext* ctx_;  // valid until OnDone
  std::function<void()> on_cancel_;
  uint64_t writes_done_ = 0;
  bool last_foldable_ = false;  // queue_.back() came from SendFoldable
  grpc::Status status_;
  bool writing_ = false, finishing_ = false, finished_called_ = false;
  bool cancelled_ = false, done_ = false, cancelling_ = false;
};

}  // namespace kvwire
