// The decode node's KV memory: a fixed budget of bytes handed out in whole pages, reserved at
// admission and returned when a sequence ends, so the pool can never be oversubscribed and
// every page comes back however a request ends.
//
// Two kinds, by where the kernels read the cache:
//   host    (cpu, reference) each allocation is its own region of host memory; the pages are
//           the accounting's unit (KvCache::Create lays a cache out in one region).
//   backend (a GPU; the guarded backend) one slab of the backend's memory made once, carved
//           into pages: a cache's K and V rows in pages anywhere in it (KvCache::CreatePaged,
//           FlashInfer's paged layout), a sequence's other state (sparse attention's page
//           summaries) in runs of consecutive pages. Nothing is allocated per sequence on the
//           device, and a full pool is RESOURCE_EXHAUSTED.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/kv_cache.h"
#include "kernels/backend.h"

namespace kvwire {

class KvPool;

// The pool's accounting and slab, shared with what it handed out: pages come back to it
// whichever goes first, and the slab lives until the last of them.
struct KvPoolState;

// Pages of a backend pool, returned to it when this goes.
class KvPages {
 public:
  KvPages(std::shared_ptr<KvPoolState> pool, std::vector<int32_t> ids)
      : pool_(std::move(pool)), ids_(std::move(ids)) {}
  ~KvPages();
  KvPages(const KvPages&) = delete;
  KvPages& operator=(const KvPages&) = delete;
  const std::vector<int32_t>& ids() const { return ids_; }

 private:
  std::shared_ptr<KvPoolState> pool_;
  std::vector<int32_t> ids_;
};

class KvPool final : public KvAllocator {
 public:
  // A host pool. `on_release` runs (without locks held) whenever memory comes back.
  KvPool(size_t capacity_bytes, size_t page_bytes, std::function<void()> on_release = {});
  // A backend pool: a slab of capacity_bytes (rounded down to whole pages) of `backend`'s
  // memory. RESOURCE_EXHAUSTED when the backend cannot hold it.
  static absl::StatusOr<std::unique_ptr<KvPool>> OnBackend(
      std::shared_ptr<kernels::KernelBackend> backend, size_t capacity_bytes, size_t page_bytes,
      std::function<void()> on_release = {});
  ~KvPool() override;

  // A region of `bytes`: host memory, or on a backend a run of consecutive pages of the slab.
  // ResourceExhausted when the request does not fit now (or ever; the message says which).
  absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) override;
  // A backend pool's: `n` pages anywhere in the slab.
  absl::StatusOr<std::unique_ptr<KvPages>> AllocatePages(int64_t n);
  // A host pool's region in shared memory (SharedRegion), accounted as Allocate's: a cache that
  // a prefill node on this host writes into (the shm KV transport).
  absl::StatusOr<KvMemoryPtr> AllocateShared(size_t bytes);

  // The backend whose memory the slab is (null for a host pool), and the slab.
  kernels::KernelBackend* backend() const;
  uint8_t* slab() const;
  bool paged() const { return backend() != nullptr; }

  size_t capacity() const;
  size_t page_bytes() const;
  size_t used() const;
  size_t RoundUp(size_t bytes) const;
  bool CanEverFit(size_t bytes) const { return RoundUp(bytes) <= capacity(); }
  // Bytes a cache of `shape` takes from this pool: its pages on a backend, its region here.
  size_t BytesFor(const KvCacheShape& shape) const;
  // Runs (without locks held) whenever memory comes back.
  void set_on_release(std::function<void()> on_release);

 private:
  explicit KvPool(std::shared_ptr<KvPoolState> state) : state_(std::move(state)) {}
  std::shared_ptr<KvPoolState> state_;
};

// A host pool's shared regions as an allocator (KvCache::Create in memory a prefill node on this
// host may write: the shm transport).
class SharedKvAllocator final : public KvAllocator {
 public:
  explicit SharedKvAllocator(KvPool& pool) : pool_(pool) {}
  absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) override {
    return pool_.AllocateShared(bytes);
  }

 private:
  KvPool& pool_;
};

// Parses "4GiB", "512MiB", "1000000", "64KiB", "2G" (powers of 1024 either way).
absl::StatusOr<size_t> ParseBytes(const std::string& text);

}  // namespace kvwire
