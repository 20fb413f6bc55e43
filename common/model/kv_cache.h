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

namespace kvwire {

// A region of KV memory. The decode node's pool hands these out with accounting; the
// default allocator uses the heap.
class KvMemory {
 public:
  virtual ~KvMemory() = default;
  virtual uint8_t* data() = 0;
  virtual size_t size() const = 0;
};
using KvMemoryPtr = std::unique_ptr<KvMemory>;

class KvAllocator {
 public:
  virtual ~KvAllocator() = default;
  virtual absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) = 0;
};

// A process-wide heap allocator, for tools and tests.
KvAllocator& HeapKvAllocator();

// One layer of one sequence.
struct LayerCache {
  int n_heads = 0;  // cache heads
  int head_dim = 0;
  DType dtype = DType::kF32;
  int capacity = 0;      // tokens per head the storage holds
  int len = 0;           // tokens per head stored
  uint8_t* k = nullptr;  // [n_heads, capacity, head_dim]
  uint8_t* v = nullptr;
  int32_t* positions = nullptr;  // [n_heads, capacity]: original position of each token

  int64_t head_stride() const { return int64_t{capacity} * head_dim; }
  size_t row_bytes() const { return static_cast<size_t>(head_dim) * DTypeSize(dtype); }
  uint8_t* k_row(int head, int t) {
    return k + (head * head_stride() + int64_t{t} * head_dim) * DTypeSize(dtype);
  }
  uint8_t* v_row(int head, int t) {
    return v + (head * head_stride() + int64_t{t} * head_dim) * DTypeSize(dtype);
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
};

class KvCache {
 public:
  // Allocates one region for all layers: K, V and positions for capacity[l] tokens.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheShape& shape,
                                                         KvAllocator& allocator);
  // Bytes Create would allocate for `shape`: what admission control reserves.
  static size_t BytesFor(const KvCacheShape& shape);

  int num_layers() const { return static_cast<int>(layers_.size()); }
  LayerCache& layer(int l) { return layers_[l]; }
  const LayerCache& layer(int l) const { return layers_[l]; }
  const KvCacheShape& shape() const { return shape_; }
  size_t allocated_bytes() const { return memory_->size(); }
  // Bytes of K and V actually stored (len tokens), summed over layers.
  int64_t StoredBytes() const;

  // Original prompt length: the RoPE position of the first generated token.
  int prompt_len() const { return prompt_len_; }
  void set_prompt_len(int n) { prompt_len_ = n; }

  // What a model keeps beside this cache, destroyed with it: a model on a GPU keeps a copy of
  // the rows in device memory, where it appends the generated tokens' rows (their host rows
  // are then not written; positions and len are).
  class Attachment {
   public:
    virtual ~Attachment() = default;
  };
  Attachment* attachment() const { return attachment_.get(); }
  void set_attachment(std::unique_ptr<Attachment> a) { attachment_ = std::move(a); }

 private:
  KvCacheShape shape_;
  KvMemoryPtr memory_;
  std::vector<LayerCache> layers_;
  int prompt_len_ = 0;
  std::unique_ptr<Attachment> attachment_;
};

}  // namespace kvwire
