#include "kernels/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace kvwire::kernels {
namespace {

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  ThreadPool pool(3);
  for (int64_t n : {0, 1, 7, 37, 733, 100000}) {
    for (int64_t grain : {1, 8, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, grain, [&](int64_t b, int64_t e) {
        EXPECT_LT(b, e);
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
    }
  }
}

// Guided scheduling: ranges shrink as the work runs out (each is the larger of the grain and a
// share of what is left), so no thread is left with a long last range while the others wait.
TEST(ThreadPool, RangesShrinkTowardsTheEndAndKeepTheGrain) {
  ThreadPool pool(2);
  for (int64_t n : {1, 9, 512, 100000}) {
    for (int64_t grain : {1, 4, 64}) {
      std::mutex mu;
      std::vector<std::pair<int64_t, int64_t>> ranges;
      pool.ParallelFor(n, grain, [&](int64_t b, int64_t e) {
        std::lock_guard<std::mutex> lock(mu);
        ranges.emplace_back(b, e);
      });
      std::sort(ranges.begin(), ranges.end());
      SCOPED_TRACE(testing::Message() << "n=" << n << " grain=" << grain);
      ASSERT_FALSE(ranges.empty());
      EXPECT_EQ(ranges.front().first, 0);
      EXPECT_EQ(ranges.back().second, n);
      for (size_t i = 0; i < ranges.size(); ++i) {
        const int64_t len = ranges[i].second - ranges[i].first;
        if (ranges[i].second < n) {
          EXPECT_GE(len, grain);
        }
        if (i == 0) continue;
        EXPECT_EQ(ranges[i].first, ranges[i - 1].second);
        EXPECT_LE(len, ranges[i - 1].second - ranges[i - 1].first);
      }
      // The first range is a quarter of the work (two threads, half each, guided), not all.
      if (n >= 4 * grain) {
        EXPECT_EQ(ranges.front().second, std::max(grain, n / 4));
        EXPECT_GT(ranges.size(), 2u);
      }
    }
  }
}

TEST(ThreadPool, UsesMoreThanOneThread) {
  ThreadPool pool(2);
  std::atomic<int> concurrent{0}, peak{0};
  pool.ParallelFor(8, 1, [&](int64_t, int64_t) {
    const int now = ++concurrent;
    int p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    --concurrent;
  });
  EXPECT_EQ(peak.load(), 2);
}

TEST(ThreadPool, CallersFromSeveralThreadsTakeTurns) {
  ThreadPool pool(2);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int r = 0; r < 200; ++r) {
        pool.ParallelFor(100, 1, [&](int64_t b, int64_t e) { total += e - b; });
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(total.load(), 4 * 200 * 100);
}

}  // namespace
}  // namespace kvwire::kernels
