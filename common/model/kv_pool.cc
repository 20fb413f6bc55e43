#include "common/model/kv_pool.h"

#include <cstdlib>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvwire {

struct KvPoolState {
  size_t capacity, page_bytes;
  std::atomic<size_t> used{0};
  std::mutex mu;
  std::function<void()> on_release;  // under mu
  // A backend pool's.
  std::shared_ptr<kernels::KernelBackend> backend;
  uint8_t* slab = nullptr;
  std::set<int32_t> free;  // under mu

  ~KvPoolState() {
    if (backend != nullptr) backend->Free(slab);
  }
  void Release(size_t bytes) {
    std::function<void()> notify;
    {
      std::lock_guard<std::mutex> lock(mu);
      used -= bytes;
      notify = on_release;
    }
    if (notify) notify();
  }
  void ReturnPages(const std::vector<int32_t>& ids) {
    {
      std::lock_guard<std::mutex> lock(mu);
      free.insert(ids.begin(), ids.end());
    }
    Release(ids.size() * page_bytes);
  }
  absl::Status Full(size_t reserved) const {
    if (reserved > capacity) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the request needs ", reserved, " bytes of KV cache but the pool holds ",
                       capacity, " (--kv-pool-bytes); lower max_tokens or the compression budget"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV pool full: ", used.load(), " of ", capacity, " bytes in use, ", reserved, " needed"));
  }
};

namespace {

// A region of the pool: host memory of its own, or a run of the slab's pages.
class PooledMemory final : public KvMemory {
 public:
  PooledMemory(std::shared_ptr<KvPoolState> pool, uint8_t* data, size_t size, size_t reserved,
               std::vector<int32_t> run = {})
      : pool_(std::move(pool)),
        data_(data),
        size_(size),
        reserved_(reserved),
        run_(std::move(run)) {}
  ~PooledMemory() override {
    if (run_.empty()) {
      std::free(data_);
      pool_->Release(reserved_);
    } else {
      pool_->ReturnPages(run_);
    }
  }
  uint8_t* data() override { return data_; }
  size_t size() const override { return size_; }
  kernels::KernelBackend* backend() const override { return pool_->backend.get(); }

 private:
  std::shared_ptr<KvPoolState> pool_;
  uint8_t* data_;
  size_t size_, reserved_;
  std::vector<int32_t> run_;  // a backend pool's pages
};

// A host pool's region in shared memory.
class SharedMemory final : public KvMemory {
 public:
  SharedMemory(std::shared_ptr<KvPoolState> pool, std::unique_ptr<SharedRegion> region, size_t size,
               size_t reserved)
      : pool_(std::move(pool)), region_(std::move(region)), size_(size), reserved_(reserved) {}
  ~SharedMemory() override {
    region_.reset();
    pool_->Release(reserved_);
  }
  uint8_t* data() override { return region_->data(); }
  size_t size() const override { return size_; }
  SharedRegion* shared() const override { return region_.get(); }

 private:
  std::shared_ptr<KvPoolState> pool_;
  std::unique_ptr<SharedRegion> region_;
  size_t size_, reserved_;
};

}  // namespace

absl::StatusOr<KvMemoryPtr> KvPool::AllocateShared(size_t bytes) {
  if (paged()) {
    return absl::FailedPreconditionError(
        "a backend pool's memory is the backend's: a shared host region comes from a host pool");
  }
  KvPoolState& s = *state_;
  const size_t reserved = RoundUp(bytes == 0 ? 1 : bytes);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (reserved > s.capacity || s.used.load() + reserved > s.capacity) return s.Full(reserved);
    s.used += reserved;
  }
  auto region = SharedRegion::Create(bytes == 0 ? 1 : bytes);
  if (!region.ok()) {
    s.Release(reserved);
    return region.status();
  }
  return KvMemoryPtr(new SharedMemory(state_, std::move(*region), bytes, reserved));
}

KvPages::~KvPages() { pool_->ReturnPages(ids_); }

KvPool::KvPool(size_t capacity_bytes, size_t page_bytes, std::function<void()> on_release)
    : state_(std::make_shared<KvPoolState>()) {
  state_->capacity = capacity_bytes;
  state_->page_bytes = page_bytes == 0 ? 1 : page_bytes;
  state_->on_release = std::move(on_release);
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::OnBackend(
    std::shared_ptr<kernels::KernelBackend> backend, size_t capacity_bytes, size_t page_bytes,
    std::function<void()> on_release) {
  if (page_bytes == 0 || page_bytes % 64 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a backend KV pool's page must be a positive multiple of 64 bytes, got ", page_bytes));
  }
  const size_t pages = capacity_bytes / page_bytes;
  if (pages == 0 || pages > (size_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a backend KV pool of ", capacity_bytes, " bytes in pages of ", page_bytes,
                     " bytes holds ", pages, " pages; it needs 1 to 2^31 - 1"));
  }
  auto slab = backend->Allocate(pages * page_bytes);
  if (!slab.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a KV pool of ", (pages * page_bytes) >> 20, " MiB does not fit in ",
                     kernels::BackendName(backend->kind()), " memory: ", slab.status().message()));
  }
  auto state = std::make_shared<KvPoolState>();
  state->capacity = pages * page_bytes;
  state->page_bytes = page_bytes;
  state->on_release = std::move(on_release);
  state->slab = static_cast<uint8_t*>(*slab);
  state->backend = std::move(backend);
  for (size_t i = 0; i < pages; ++i) state->free.insert(state->free.end(), static_cast<int32_t>(i));
  return std::unique_ptr<KvPool>(new KvPool(std::move(state)));
}

KvPool::~KvPool() = default;

kernels::KernelBackend* KvPool::backend() const { return state_->backend.get(); }
uint8_t* KvPool::slab() const { return state_->slab; }
size_t KvPool::capacity() const { return state_->capacity; }
size_t KvPool::page_bytes() const { return state_->page_bytes; }
size_t KvPool::used() const { return state_->used.load(); }

void KvPool::set_on_release(std::function<void()> on_release) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->on_release = std::move(on_release);
}

size_t KvPool::RoundUp(size_t bytes) const {
  return (bytes + page_bytes() - 1) / page_bytes() * page_bytes();
}

size_t KvPool::BytesFor(const KvCacheShape& shape) const {
  return paged() ? KvCache::PagedPages(shape, page_bytes()) * page_bytes()
                 : KvCache::BytesFor(shape);
}

absl::StatusOr<KvMemoryPtr> KvPool::Allocate(size_t bytes) {
  KvPoolState& s = *state_;
  const size_t reserved = RoundUp(bytes == 0 ? 1 : bytes);
  if (paged()) {
    // A run of consecutive pages, first fit from the slab's low end (KV pages are taken from
    // the high end, so runs find room).
    const int64_t n = static_cast<int64_t>(reserved / s.page_bytes);
    std::vector<int32_t> run;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (reserved > s.capacity || s.used.load() + reserved > s.capacity) return s.Full(reserved);
      int32_t start = -1, last = -2;
      int64_t length = 0;
      for (int32_t id : s.free) {
        if (id != last + 1) {
          start = id;
          length = 0;
        }
        last = id;
        if (++length == n) break;
      }
      if (length < n) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "KV pool: no run of ", n, " free pages of ", s.page_bytes, " bytes (", s.used.load(),
            " of ", s.capacity, " bytes in use; the free pages are scattered)"));
      }
      for (int32_t id = start; id < start + n; ++id) {
        s.free.erase(id);
        run.push_back(id);
      }
      s.used += reserved;
    }
    uint8_t* data = s.slab + static_cast<size_t>(run.front()) * s.page_bytes;
    return KvMemoryPtr(new PooledMemory(state_, data, bytes, reserved, std::move(run)));
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (reserved > s.capacity || s.used.load() + reserved > s.capacity) return s.Full(reserved);
    s.used += reserved;
  }
  uint8_t* data = AllocateHostBytes(bytes);
  if (data == nullptr) {
    s.Release(reserved);
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return KvMemoryPtr(new PooledMemory(state_, data, bytes, reserved));
}

absl::StatusOr<std::unique_ptr<KvPages>> KvPool::AllocatePages(int64_t n) {
  if (!paged()) {
    return absl::FailedPreconditionError("KV pages come from a backend pool, not a host one");
  }
  KvPoolState& s = *state_;
  const size_t reserved = static_cast<size_t>(n) * s.page_bytes;
  std::vector<int32_t> ids;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (n < 0 || reserved > s.capacity || s.used.load() + reserved > s.capacity) {
      return s.Full(reserved);
    }
    for (int64_t i = 0; i < n; ++i) {
      auto last = std::prev(s.free.end());
      ids.push_back(*last);
      s.free.erase(last);
    }
    s.used += reserved;
  }
  return std::make_unique<KvPages>(state_, std::move(ids));
}

absl::StatusOr<size_t> ParseBytes(const std::string& text) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  size_t mult = 1;
  for (const auto& [suffix, m] : std::vector<std::pair<std::string, size_t>>{{"kib", 1ull << 10},
                                                                             {"mib", 1ull << 20},
                                                                             {"gib", 1ull << 30},
                                                                             {"tib", 1ull << 40},
                                                                             {"kb", 1ull << 10},
                                                                             {"mb", 1ull << 20},
                                                                             {"gb", 1ull << 30},
                                                                             {"k", 1ull << 10},
                                                                             {"m", 1ull << 20},
                                                                             {"g", 1ull << 30},
                                                                             {"b", 1}}) {
    if (s.size() > suffix.size() &&
        s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
      mult = m;
      s.resize(s.size() - suffix.size());
      break;
    }
  }
  double v = 0;
  if (!absl::SimpleAtod(s, &v) || !(v >= 0) || v * mult > 1e18) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a byte size (e.g. 4GiB, 512MiB)"));
  }
  return static_cast<size_t>(v * mult);
}

}  // namespace kvwire
