// The decode node's KV memory: a fixed budget of bytes handed out in whole pages. A
// sequence's cache (its compressed prompt plus room for max_tokens) is one allocation,
// reserved at admission and returned when the sequence ends, so the pool can never be
// oversubscribed and every page comes back however a request ends.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <mutex>

#include "common/model/kv_cache.h"

namespace kvwire {

class KvPool final : public KvAllocator {
 public:
  // `on_release` runs (without locks held) whenever memory comes back.
  KvPool(size_t capacity_bytes, size_t page_bytes, std::function<void()> on_release = {});

  // ResourceExhausted when the request does not fit now (or ever; the message says which).
  absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) override;

  size_t capacity() const { return capacity_; }
  size_t page_bytes() const { return page_bytes_; }
  size_t used() const { return used_.load(); }
  size_t RoundUp(size_t bytes) const;
  bool CanEverFit(size_t bytes) const { return RoundUp(bytes) <= capacity_; }

 private:
  friend class PooledMemory;
  void Release(size_t bytes);

  const size_t capacity_, page_bytes_;
  std::atomic<size_t> used_{0};
  std::mutex mu_;
  std::function<void()> on_release_;
};

// Parses "4GiB", "512MiB", "1000000", "64KiB", "2G" (powers of 1024 either way).
absl::StatusOr<size_t> ParseBytes(const std::string& text);

}  // namespace kvwire
