#include "kernels/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvwire::kernels {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Spinning long enough to bridge consecutive decode kernels, short enough not to steal a core
// from other processes for long.
constexpr int kSpinIterations = 2000;

}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

// Guided self-scheduling (Polychronopoulos and Kuck, 1987; OpenMP's schedule(guided)): each
// grab takes the larger of the grain and 1/(2·threads) of what is left, so ranges start long
// (long forward streams through W for a matrix product) and shrink towards the end, where
// equal chunks left one thread idle while the other finished its last one
// (docs/benchmarks.md, "Engine").
void ThreadPool::RunChunks() {
  const int64_t parts = 2 * size();
  int64_t begin = next_.load(std::memory_order_relaxed);
  for (;;) {
    int64_t len;
    do {
      if (begin >= n_) return;
      len = std::min(n_ - begin, std::max(grain_, (n_ - begin) / parts));
    } while (!next_.compare_exchange_weak(begin, begin + len, std::memory_order_relaxed));
    (*fn_)(begin, begin + len);
    begin = next_.load(std::memory_order_relaxed);
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (workers_.empty() || n <= grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> job_lock(job_mu_);
  n_ = n;
  grain_ = grain;
  fn_ = &fn;
  next_.store(0, std::memory_order_relaxed);
  pending_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  { std::lock_guard<std::mutex> lock(mu_); }
  wake_.notify_all();

  RunChunks();

  for (int i = 0; i < kSpinIterations; ++i) {
    if (pending_workers_.load(std::memory_order_acquire) == 0) return;
    CpuRelax();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_workers_.load(std::memory_order_acquire) == 0; });
}

void ThreadPool::WorkerLoop(int /*index*/) {
  // Generation 0 is the pool's start: a worker that starts late must still join the
  // first job, so it must not read the counter here.
  uint64_t seen = 0;
  for (;;) {
    bool ready = false;
    for (int i = 0; i < kSpinIterations; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) {
        ready = true;
        break;
      }
      CpuRelax();
    }
    if (!ready) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock,
                 [&] { return stop_ || generation_.load(std::memory_order_acquire) != seen; });
      if (stop_) return;
    }
    seen = generation_.load(std::memory_order_acquire);
    RunChunks();
    if (pending_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_all();
    }
  }
}

}  // namespace kvwire::kernels
