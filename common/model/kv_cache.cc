#include "common/model/kv_cache.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvwire {
namespace {

constexpr size_t kAlign = 64;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

class HeapMemory final : public KvMemory {
 public:
  HeapMemory(uint8_t* data, size_t size) : data_(data), size_(size) {}
  ~HeapMemory() override { std::free(data_); }
  uint8_t* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  uint8_t* data_;
  size_t size_;
};

class HeapAllocator final : public KvAllocator {
 public:
  absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) override {
    uint8_t* p = AllocateHostBytes(bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes of KV"));
    }
    return KvMemoryPtr(new HeapMemory(p, bytes));
  }
};

// Per layer: K, V, then positions, each aligned.
size_t LayerBytes(const KvCacheShape& s, int capacity) {
  const size_t rows = static_cast<size_t>(s.n_heads) * capacity;
  return 2 * AlignUp(rows * s.head_dim * DTypeSize(s.dtype)) + AlignUp(rows * sizeof(int32_t));
}

}  // namespace

KvAllocator& HeapKvAllocator() {
  static HeapAllocator* allocator = new HeapAllocator();
  return *allocator;
}

size_t KvCache::BytesFor(const KvCacheShape& shape) {
  size_t total = 0;
  for (int c : shape.capacity) total += LayerBytes(shape, c);
  return total;
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheShape& shape,
                                                         KvAllocator& allocator) {
  if (shape.n_heads <= 0 || shape.head_dim <= 0 || shape.capacity.empty()) {
    return absl::InvalidArgumentError("KV cache shape needs heads, head_dim and layers");
  }
  for (int c : shape.capacity) {
    if (c < 0) return absl::InvalidArgumentError("KV cache capacity must be >= 0");
  }
  auto cache = std::unique_ptr<KvCache>(new KvCache());
  cache->shape_ = shape;
  auto mem = allocator.Allocate(BytesFor(shape));
  if (!mem.ok()) return mem.status();
  cache->memory_ = std::move(*mem);
  uint8_t* p = cache->memory_->data();
  for (int c : shape.capacity) {
    LayerCache l;
    l.n_heads = shape.n_heads;
    l.head_dim = shape.head_dim;
    l.dtype = shape.dtype;
    l.capacity = c;
    const size_t rows = static_cast<size_t>(shape.n_heads) * c;
    const size_t kv_bytes = AlignUp(rows * shape.head_dim * DTypeSize(shape.dtype));
    l.k = p;
    l.v = p + kv_bytes;
    l.positions = reinterpret_cast<int32_t*>(p + 2 * kv_bytes);
    p += LayerBytes(shape, c);
    cache->layers_.push_back(l);
  }
  return cache;
}

int64_t KvCache::StoredBytes() const {
  int64_t total = 0;
  for (const LayerCache& l : layers_) total += int64_t{2} * l.n_heads * l.len * l.row_bytes();
  return total;
}

}  // namespace kvwire
