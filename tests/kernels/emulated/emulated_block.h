// One CUDA thread block run on the host, for testing a kernel's logic where no GPU is: the
// block's threads are cooperative fibers on one OS thread (ucontext), __syncthreads a barrier
// over them, a warp's shuffles an exchange through a buffer between two barriers of its 32
// threads. A scheduling order (Order) decides which thread runs next, so that a missing barrier
// shows up as a wrong result under some order. Not for sanitizer builds: ASan and TSan do not
// follow swapcontext's stacks.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

namespace kvwire::emulated {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// Round robin forward, backward or shuffled each round; or one thread runs until it waits, the
// next runnable one by a fixed priority (lowest first, highest first, shuffled once): a warp
// runs ahead of the others up to the next barrier.
enum class Order { kForward, kBackward, kShuffled, kAheadLowest, kAheadHighest, kAheadShuffled };
inline constexpr Order kOrders[] = {Order::kForward,      Order::kBackward,
                                    Order::kShuffled,     Order::kAheadLowest,
                                    Order::kAheadHighest, Order::kAheadShuffled};

struct Block {
  struct Thread {
    ucontext_t context;
    bool done = false;
    int waiting = 0;  // 0 runnable, 1 at the block barrier, 2 at its warp's
    long generation = 0;
  };
  std::vector<Thread> threads;
  ucontext_t scheduler;
  int current = 0;
  Dim3 index;
  int arrived = 0;
  long generation = 0;
  int warp_arrived[32] = {};
  long warp_generation[32] = {};
  uint64_t exchange[32][32];           // a shuffle's values, up to 8 bytes each
  std::vector<unsigned char> dynamic;  // the launch's dynamic shared memory
  bool progress = false;
  std::function<void()> body;
};
inline Block* current_block = nullptr;
inline int64_t misaligned = 0;  // vector loads from addresses not a multiple of their size

inline Dim3 ThreadIdx() { return Dim3{static_cast<unsigned>(current_block->current), 0, 0}; }
inline Dim3 BlockIdx() { return current_block->index; }
inline Dim3 BlockDim() { return Dim3{static_cast<unsigned>(current_block->threads.size()), 1, 1}; }

inline void Yield() {
  Block& b = *current_block;
  swapcontext(&b.threads[b.current].context, &b.scheduler);
}

inline void SyncThreads() {
  Block& b = *current_block;
  const long generation = b.generation;
  b.progress = true;
  if (++b.arrived == static_cast<int>(b.threads.size())) {
    b.arrived = 0;
    ++b.generation;
    Yield();  // the others run first
    return;
  }
  b.threads[b.current].waiting = 1;
  b.threads[b.current].generation = generation;
  while (b.generation == generation) Yield();
  b.threads[b.current].waiting = 0;
}

inline void SyncWarp(int warp) {
  Block& b = *current_block;
  const long generation = b.warp_generation[warp];
  b.progress = true;
  if (++b.warp_arrived[warp] == 32) {
    b.warp_arrived[warp] = 0;
    ++b.warp_generation[warp];
    Yield();
    return;
  }
  b.threads[b.current].waiting = 2;
  b.threads[b.current].generation = generation;
  while (b.warp_generation[warp] == generation) Yield();
  b.threads[b.current].waiting = 0;
}

// __syncwarp() of the running thread's warp.
inline void SyncOwnWarp() { SyncWarp(current_block->current / 32); }

template <typename T>
inline T ShuffleXor(T v, int offset) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  Block& b = *current_block;
  const int warp = b.current / 32, lane = b.current % 32;
  std::memcpy(&b.exchange[warp][lane], &v, sizeof(T));
  SyncWarp(warp);
  T r;
  std::memcpy(&r, &b.exchange[warp][lane ^ offset], sizeof(T));
  SyncWarp(warp);
  return r;
}

// The block's dynamic shared memory, as T (RunBlock's shared_bytes, 16-byte aligned).
template <typename T>
inline T* DynamicShared() {
  return reinterpret_cast<T*>(current_block->dynamic.data());
}

inline void Entry() {
  Block& b = *current_block;
  b.body();
  b.threads[b.current].done = true;
  b.progress = true;
  swapcontext(&b.threads[b.current].context, &b.scheduler);
}

// Runs body() as `threads` threads of block `index` (a whole number of warps, at most 1024),
// with `shared_bytes` of dynamic shared memory (filled with NaN's bytes, as memory no thread
// wrote). False if the threads deadlocked (some wait at a barrier the others never reach).
inline bool RunBlock(int threads, Dim3 index, Order order, uint32_t seed,
                     std::function<void()> body, size_t shared_bytes = 0) {
  constexpr size_t kStack = 256 * 1024;
  static std::vector<std::unique_ptr<char[]>> stacks;
  while (static_cast<int>(stacks.size()) < threads) stacks.emplace_back(new char[kStack]);
  Block b;
  b.threads.resize(threads);
  b.index = index;
  b.body = std::move(body);
  b.dynamic.assign(shared_bytes, 0xFF);  // 0xFFFFFFFF: a NaN as float
  current_block = &b;
  for (int i = 0; i < threads; ++i) {
    Block::Thread& t = b.threads[i];
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = stacks[i].get();
    t.context.uc_stack.ss_size = kStack;
    t.context.uc_link = nullptr;
    makecontext(&t.context, Entry, 0);
  }
  std::mt19937 rng(seed);
  std::vector<int> priority(threads);
  for (int i = 0; i < threads; ++i) priority[i] = i;
  if (order == Order::kBackward || order == Order::kAheadHighest) {
    std::reverse(priority.begin(), priority.end());
  }
  if (order == Order::kAheadShuffled) std::shuffle(priority.begin(), priority.end(), rng);
  const bool ahead = order == Order::kAheadLowest || order == Order::kAheadHighest ||
                     order == Order::kAheadShuffled;
  bool ok = true;
  if (ahead) {
    auto runnable = [&](int i) {
      const Block::Thread& t = b.threads[i];
      if (t.done) return false;
      if (t.waiting == 1) return b.generation != t.generation;
      if (t.waiting == 2) return b.warp_generation[i / 32] != t.generation;
      return true;
    };
    for (;;) {
      int pick = -1;
      bool any = false;
      for (int i : priority) {
        any |= !b.threads[i].done;
        if (runnable(i)) {
          pick = i;
          break;
        }
      }
      if (!any) break;
      if (pick < 0) {
        ok = false;
        break;
      }
      b.current = pick;
      swapcontext(&b.scheduler, &b.threads[pick].context);
    }
  } else {
    int idle = 0;
    for (;;) {
      bool any = false;
      b.progress = false;
      if (order == Order::kShuffled) std::shuffle(priority.begin(), priority.end(), rng);
      for (int i : priority) {
        if (b.threads[i].done) continue;
        any = true;
        b.current = i;
        swapcontext(&b.scheduler, &b.threads[i].context);
      }
      if (!any) break;
      idle = b.progress ? 0 : idle + 1;
      if (idle > 3) {
        ok = false;
        break;
      }
    }
  }
  current_block = nullptr;
  return ok;
}

// Runs body() as every block of `grid` (x fastest), `threads` threads each, all under `order`
// (a seed of their own each); false on a deadlock.
inline bool RunGrid(Dim3 grid, int threads, Order order, const std::function<void()>& body,
                    size_t shared_bytes = 0) {
  for (unsigned z = 0; z < std::max(grid.z, 1u); ++z) {
    for (unsigned y = 0; y < std::max(grid.y, 1u); ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        if (!RunBlock(threads, {x, y, z}, order, x * 131 + y * 7 + z, body, shared_bytes)) {
          return false;
        }
      }
    }
  }
  return true;
}

}  // namespace kvwire::emulated
