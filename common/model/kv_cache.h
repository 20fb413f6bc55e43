// The per-sequence KV cache that decode attends over: per layer, per cache head, the kept
// prompt positions in ascending order followed by the generated tokens, with K (after
// RoPE) and V rows in the cache's dtype. A compressed cache is just one whose layers hold
// fewer prompt tokens than the prompt had; RoPE positions of generated tokens continue
// from the original prompt length regardless.
//
// Cache heads are the model's KV heads, or its query heads for a cache compressed per
// query head (the original SnapKV under GQA, n_rep times larger).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/dtype.h"
#include "common/base/host_alloc.h"
#include "common/base/kv_format.h"
#include "common/base/shared_region.h"
#include "kernels/backend.h"

namespace kvwire {

// A region of KV memory. The decode node's pool hands these out with accounting; the
// default allocator uses the heap.
class KvMemory {
 public:
  virtual ~KvMemory() = default;
  virtual uint8_t* data() = 0;
  virtual size_t size() const = 0;
  // The backend whose memory this is (a KvPool on a backend), or null for host memory.
  virtual kernels::KernelBackend* backend() const { return nullptr; }
  // Host memory another process on this host may map (KvPool::AllocateShared), or null.
  virtual SharedRegion* shared() const { return nullptr; }
};
using KvMemoryPtr = std::unique_ptr<KvMemory>;

class KvAllocator {
 public:
  virtual ~KvAllocator() = default;
  virtual absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) = 0;
};

// A process-wide heap allocator, for tools and tests.
KvAllocator& HeapKvAllocator();

// One layer of one sequence. Its rows are in one region of host memory (a host cache), or in
// pages of a backend pool (a paged cache, KvCache::CreatePaged), where only the backend's ops
// read them; positions and len are the host's either way.
struct LayerCache {
  int n_heads = 0;  // cache heads
  int head_dim = 0;
  DType dtype = DType::kF32;
  int capacity = 0;      // tokens per head the storage holds
  int len = 0;           // tokens per head stored
  uint8_t* k = nullptr;  // a region [n_heads, capacity, head_dim]; or the pool's K pages
  uint8_t* v = nullptr;
  int32_t* positions = nullptr;  // [n_heads, capacity]: original position of each token
  kernels::KvLayout layout;      // where token t of head c is, from k and from v

  // A coded cache (format fp8, int8 or int4) keeps the wire's codes (common/base/kv_format.h):
  // k and v hold key code rows and value rows (bytes, at layout and coding.v_layout), and beside
  // them each group's parameters, and the tokens decode appended since the last whole group in
  // `dtype` (KIVI's residual) until a group of kKeyGroupTokens fills and is coded. What the
  // kernels read; format kAuto (rows in dtype) for any other cache.
  kernels::KvCoding coding;

  bool paged() const { return layout.pages != nullptr; }
  bool coded() const { return coding.coded(); }
  // A region's: elements between heads.
  int64_t head_stride() const { return int64_t{capacity} * head_dim; }
  size_t row_bytes() const { return static_cast<size_t>(head_dim) * DTypeSize(dtype); }
  // Bytes one head's len tokens take as kept: K and V rows in dtype, or a coded cache's code
  // rows, its groups' parameters and scales so far, and its residual's rows.
  int64_t HeadBytes() const;
  // Rows in host memory only (a host cache, or a paged one on a host backend).
  uint8_t* k_row(int head, int t) {
    return k + layout.Row(head, t, head_dim) * static_cast<int64_t>(DTypeSize(dtype));
  }
  uint8_t* v_row(int head, int t) {
    return v + layout.Row(head, t, head_dim) * static_cast<int64_t>(DTypeSize(dtype));
  }
  const uint8_t* k_row(int head, int t) const {
    return const_cast<LayerCache*>(this)->k_row(head, t);
  }
  const uint8_t* v_row(int head, int t) const {
    return const_cast<LayerCache*>(this)->v_row(head, t);
  }
  int32_t position(int head, int t) const { return positions[int64_t{head} * capacity + t]; }
};

struct KvCacheShape {
  int n_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;
  std::vector<int> capacity;  // per layer
  // Rows coded as the wire ships them (a coded KvFormat), or in dtype (kAuto); `appended` of
  // each layer's capacity are for the tokens decode appends (a coded cache's residual).
  KvFormat format = KvFormat::kAuto;
  int appended = 0;
};

class KvPool;
class KvPages;

class KvCache {
 public:
  // Allocates one region for all layers: K, V and positions for capacity[l] tokens.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheShape& shape,
                                                         KvAllocator& allocator);
  // Bytes Create would allocate for `shape`: what admission control reserves.
  static size_t BytesFor(const KvCacheShape& shape);
  // A cache in pages of a backend pool (KvPool::OnBackend), in FlashInfer's paged layout: a page
  // holds page_tokens rows of every cache head, K then V ([n_heads, page_tokens, head_dim]
  // each), page_tokens = page_bytes / (2 · n_heads · row bytes); each layer's page table lists
  // its blocks' pages. Positions and the tables are host memory.
  static absl::StatusOr<std::unique_ptr<KvCache>> CreatePaged(const KvCacheShape& shape,
                                                              KvPool& pool);
  // Pages CreatePaged takes for `shape` from a pool of `page_bytes` pages (0: they hold no
  // token).
  static int64_t PagedPages(const KvCacheShape& shape, size_t page_bytes);
  // Where a paged cache lies in its pool: each layer's page table, and a coded cache's other
  // state (a run of whole pages) as an offset in the slab (-1: none). What a prefill node on the
  // same device needs to write the rows in place (the cuda_ipc KV transport).
  struct PagedPlace {
    size_t page_bytes = 0;
    std::vector<std::vector<int32_t>> tables;
    int64_t side_offset = -1;
  };
  absl::StatusOr<PagedPlace> paged_place() const;
  // A paged cache over `slab`, `slab_bytes` of `backend`'s memory that another process's pool
  // allocated (mapped by KernelBackend::ImportMemory), laid out as that pool's cache of `shape`
  // at `place`: every table and offset is checked against the shape and the slab. It owns no
  // pages; its positions are its own host memory.
  // Whether `place` lays a cache of `shape` out in a slab of `slab_bytes` (CreatePagedView's
  // checks, for a node that only checks a request).
  static absl::Status CheckPagedPlace(const KvCacheShape& shape, size_t slab_bytes,
                                      const PagedPlace& place);
  static absl::StatusOr<std::unique_ptr<KvCache>> CreatePagedView(const KvCacheShape& shape,
                                                                  kernels::KernelBackend* backend,
                                                                  uint8_t* slab, size_t slab_bytes,
                                                                  const PagedPlace& place);
  // In `pool`: paged on a backend pool, one region in a host pool.
  static absl::StatusOr<std::unique_ptr<KvCache>> CreateIn(const KvCacheShape& shape, KvPool& pool);
  ~KvCache();

  int num_layers() const { return static_cast<int>(layers_.size()); }
  LayerCache& layer(int l) { return layers_[l]; }
  const LayerCache& layer(int l) const { return layers_[l]; }
  const KvCacheShape& shape() const { return shape_; }
  // The backend whose memory holds the rows (a paged cache's pool), or null: host memory.
  kernels::KernelBackend* backend() const { return backend_; }
  // The shared host region the cache lives in (KvPool::AllocateShared), or null.
  SharedRegion* shared_region() const { return memory_ ? memory_->shared() : nullptr; }
  // Whether the host may read the rows (k_row, v_row).
  bool host_rows() const { return backend_ == nullptr || backend_->host_addressable(); }
  // Bytes of K and V actually stored (len tokens), summed over layers.
  int64_t StoredBytes() const;

  // Writes `count` rows of head `head` from token t0 of `layer` (K and V in the cache dtype,
  // consecutive): copied in place on the host, or to the backend's pages.
  absl::Status WriteRows(int layer, int head, int t0, int count, const uint8_t* k,
                         const uint8_t* v);
  // A coded layer's block of tokens [first, first + n) of `head`, as the wire codes it
  // (common/base/kv_format.h): K codes then the groups' parameters, value rows then (fp8) the
  // groups' scales. The layer's `kept` must be set.
  absl::Status WriteCodedBlock(int layer, int head, int first, int n, const uint8_t* k,
                               const uint8_t* v);
  // A coded layer's code rows per head (its tokens but those its residual holds).
  int CodedRows(int layer) const;
  // Every layer's rows, positions and lengths of `from` (a cache of the same shape whose rows
  // the host reads), as the wire would deliver them.
  absl::Status CopyFrom(const KvCache& from);

  // Original prompt length: the RoPE position of the first generated token.
  int prompt_len() const { return prompt_len_; }
  void set_prompt_len(int n) { prompt_len_ = n; }

 private:
  // Blocks (pages) per layer of a paged cache of `shape` in pages of `page_bytes`.
  static absl::StatusOr<std::vector<int>> PagedBlocks(const KvCacheShape& shape, size_t page_bytes);
  void LayOutPaged(const KvCacheShape& shape, kernels::KernelBackend* backend, uint8_t* slab,
                   size_t page_bytes, uint8_t* side_at);

  KvCacheShape shape_;
  KvMemoryPtr memory_;                        // a host cache's region
  std::unique_ptr<KvPages> pages_;            // a paged cache's pages
  std::vector<std::vector<int32_t>> tables_;  // a paged cache's, per layer
  std::vector<int32_t> positions_;            // a paged cache's, all layers
  size_t page_bytes_ = 0;                     // a paged cache's
  kernels::KernelBackend* backend_ = nullptr;
  std::vector<LayerCache> layers_;
  int prompt_len_ = 0;
};

}  // namespace kvwire
