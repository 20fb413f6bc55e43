#include "common/model/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/kv_pool.h"

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
    l.layout = kernels::KvLayout::Region(l.head_stride());
    p += LayerBytes(shape, c);
    cache->layers_.push_back(l);
  }
  return cache;
}

KvCache::~KvCache() = default;

int64_t KvCache::PagedPages(const KvCacheShape& shape, size_t page_bytes) {
  const size_t token =
      2 * static_cast<size_t>(shape.n_heads) * shape.head_dim * DTypeSize(shape.dtype);
  const int64_t page_tokens = static_cast<int64_t>(page_bytes / std::max<size_t>(token, 1));
  if (page_tokens == 0) return 0;
  int64_t pages = 0;
  for (int c : shape.capacity) pages += (c + page_tokens - 1) / page_tokens;
  return pages;
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::CreatePaged(const KvCacheShape& shape,
                                                              KvPool& pool) {
  if (shape.n_heads <= 0 || shape.head_dim <= 0 || shape.capacity.empty()) {
    return absl::InvalidArgumentError("KV cache shape needs heads, head_dim and layers");
  }
  for (int c : shape.capacity) {
    if (c < 0) return absl::InvalidArgumentError("KV cache capacity must be >= 0");
  }
  if (!pool.paged()) {
    return absl::FailedPreconditionError(
        "a paged KV cache needs a backend pool (KvPool::OnBackend)");
  }
  const size_t es = DTypeSize(shape.dtype);
  const size_t token = 2 * static_cast<size_t>(shape.n_heads) * shape.head_dim * es;
  const int page_tokens = static_cast<int>(pool.page_bytes() / token);
  if (page_tokens == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV page of ", pool.page_bytes(), " bytes holds no token of ", shape.n_heads,
                     " heads x ", shape.head_dim, " ", DTypeName(shape.dtype), " (", token,
                     " bytes of K and V); raise --kv-page-bytes"));
  }
  auto cache = std::unique_ptr<KvCache>(new KvCache());
  cache->shape_ = shape;
  cache->backend_ = pool.backend();
  ASSIGN_OR_RETURN(cache->pages_, pool.AllocatePages(PagedPages(shape, pool.page_bytes())));
  int64_t positions = 0;
  for (int c : shape.capacity) positions += int64_t{shape.n_heads} * c;
  cache->positions_.assign(positions, 0);
  const std::vector<int32_t>& ids = cache->pages_->ids();
  size_t next = 0;
  int64_t at = 0;
  for (int c : shape.capacity) {
    const int blocks = (c + page_tokens - 1) / page_tokens;
    cache->tables_.emplace_back(ids.begin() + next, ids.begin() + next + blocks);
    next += blocks;
    LayerCache l;
    l.n_heads = shape.n_heads;
    l.head_dim = shape.head_dim;
    l.dtype = shape.dtype;
    l.capacity = c;
    l.k = pool.slab();
    l.v = pool.slab() + static_cast<size_t>(shape.n_heads) * page_tokens * shape.head_dim * es;
    l.positions = cache->positions_.data() + at;
    at += int64_t{shape.n_heads} * c;
    l.layout.pages = cache->tables_.back().data();
    l.layout.page_tokens = page_tokens;
    l.layout.heads_per_page = shape.n_heads;
    l.layout.n_heads = shape.n_heads;
    l.layout.page_stride = static_cast<int64_t>(pool.page_bytes() / es);
    cache->layers_.push_back(l);
  }
  return cache;
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::CreateIn(const KvCacheShape& shape,
                                                           KvPool& pool) {
  return pool.paged() ? CreatePaged(shape, pool) : Create(shape, pool);
}

absl::Status KvCache::WriteRows(int layer, int head, int t0, int count, const uint8_t* k,
                                const uint8_t* v) {
  if (layer < 0 || layer >= num_layers() || head < 0 || head >= layers_[layer].n_heads || t0 < 0 ||
      count < 0 || t0 + count > layers_[layer].capacity) {
    return absl::InvalidArgumentError(absl::StrCat("rows [", t0, ", ", t0 + count, ") of head ",
                                                   head, " of layer ", layer,
                                                   " are outside the cache"));
  }
  LayerCache& lc = layers_[layer];
  const size_t row = lc.row_bytes();
  for (int t = t0; t < t0 + count;) {
    const int run = lc.layout.RunFrom(t, t0 + count);
    const size_t bytes = static_cast<size_t>(run) * row;
    const size_t from = static_cast<size_t>(t - t0) * row;
    if (host_rows()) {
      std::memcpy(lc.k_row(head, t), k + from, bytes);
      std::memcpy(lc.v_row(head, t), v + from, bytes);
    } else {
      const int64_t at =
          lc.layout.Row(head, t, lc.head_dim) * static_cast<int64_t>(DTypeSize(lc.dtype));
      RETURN_IF_ERROR(backend_->CopyToDevice(lc.k + at, k + from, bytes));
      RETURN_IF_ERROR(backend_->CopyToDevice(lc.v + at, v + from, bytes));
    }
    t += run;
  }
  return absl::OkStatus();
}

absl::Status KvCache::CopyFrom(const KvCache& from) {
  if (!from.host_rows() || from.num_layers() != num_layers() ||
      from.shape().n_heads != shape_.n_heads || from.shape().head_dim != shape_.head_dim ||
      from.shape().dtype != shape_.dtype) {
    return absl::InvalidArgumentError(
        "a KV cache copies from one of its shape whose rows are host memory");
  }
  for (int l = 0; l < num_layers(); ++l) {
    const LayerCache& src = from.layer(l);
    LayerCache& dst = layers_[l];
    if (src.len > dst.capacity) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, " holds ", src.len, " tokens; this cache has room for ", dst.capacity));
    }
    for (int c = 0; c < dst.n_heads; ++c) {
      for (int t = 0; t < src.len;) {  // the source's rows run by run (its pages, if any)
        const int run = src.layout.RunFrom(t, src.len);
        RETURN_IF_ERROR(WriteRows(l, c, t, run, src.k_row(c, t), src.v_row(c, t)));
        t += run;
      }
      std::copy_n(src.positions + int64_t{c} * src.capacity, src.len,
                  dst.positions + int64_t{c} * dst.capacity);
    }
    dst.len = src.len;
  }
  prompt_len_ = from.prompt_len();
  return absl::OkStatus();
}

int64_t KvCache::StoredBytes() const {
  int64_t total = 0;
  for (const LayerCache& l : layers_) total += int64_t{2} * l.n_heads * l.len * l.row_bytes();
  return total;
}

}  // namespace kvwire
