// A fork-join pool for data-parallel kernels: ParallelFor splits [0, n) into contiguous
// ranges, runs them on the workers and the calling thread, and returns when all are done.
// Workers spin briefly before sleeping, because decode-sized kernels last tens of
// microseconds and a condition-variable wake-up would cost as much.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvwire::kernels {

class ThreadPool {
 public:
  // `threads` counts the caller: ThreadPool(2) starts one worker. 0 means all hardware threads.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) over disjoint ranges covering [0, n), each at least `grain` long
  // (except possibly the last), in increasing order of begin as the threads take them:
  // long ranges first, shorter ones as the work runs out (guided scheduling). Safe to call
  // from several threads (jobs take turns); fn must not call ParallelFor on this pool.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);
  void RunChunks();

  std::vector<std::thread> workers_;
  std::mutex job_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_workers_{0};
  std::atomic<int64_t> next_{0};  // the start of the range the next grab takes
  bool stop_ = false;

  // The job being run (valid while a generation is active).
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
};

}  // namespace kvwire::kernels
