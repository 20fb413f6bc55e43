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

// A coded layer's parts, per head: code rows (the tokens kept and the appended tokens' whole
// groups; the rest wait in the residual), key group parameters, fp8 value scales, residual.
struct CodedSizes {
  int rows = 0, groups = 0, resid = 0;
  size_t k_row = 0, v_row = 0, params = 0, scales = 0, resid_row = 0;
};
CodedSizes CodedSizesFor(const KvCacheShape& s, int capacity) {
  CodedSizes z;
  const int appended = std::min(s.appended, capacity);
  z.rows = capacity - appended % kKeyGroupTokens;
  z.groups = KvGroups::Max(capacity);
  z.resid = std::min(kKeyGroupTokens, appended);
  z.k_row = KvKeyCodeBytes(s.format, s.dtype, s.head_dim);
  z.v_row = KvValueRowBytes(s.format, s.dtype, s.head_dim);
  z.params = KvKeyGroupBytes(s.format, s.head_dim);
  z.scales = s.format == KvFormat::kFP8 ? 1 : 0;
  z.resid_row = static_cast<size_t>(s.head_dim) * DTypeSize(s.dtype);
  return z;
}

// `bytes` from *at, which moves past them, aligned.
uint8_t* Take(size_t bytes, uint8_t** at) {
  uint8_t* part = *at;
  *at += AlignUp(bytes);
  return part;
}

// A coded layer's parameters, fp8 scales and residual, laid out from *at (CodedSideBytes).
void PlaceCodedSide(const KvCacheShape& s, const CodedSizes& z, uint8_t** at, LayerCache* l) {
  const size_t heads = static_cast<size_t>(s.n_heads);
  l->coding.format = s.format;
  l->coding.max_groups = z.groups;
  l->coding.resid_tokens = z.resid;
  l->coding.k_params = Take(heads * z.groups * z.params, at);
  l->coding.v_scales = z.scales > 0 ? Take(heads * z.groups * z.scales, at) : nullptr;
  l->coding.k_resid = Take(heads * z.resid * z.resid_row, at);
  l->coding.v_resid = Take(heads * z.resid * z.resid_row, at);
}

// A shape's rows: in its dtype, or coded (fp8, int8, int4) with >= 0 appended tokens and a
// head_dim the format can code.
absl::Status CheckCodedShape(const KvCacheShape& shape) {
  if (shape.format == KvFormat::kAuto) return absl::OkStatus();
  if (!KvCoded(shape.format) || shape.appended < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a KV cache keeps its rows in its dtype (auto) or coded (fp8, int8, int4), with >= 0 "
        "appended tokens; got ",
        KvFormatName(shape.format), " and ", shape.appended));
  }
  return CheckKvFormat(shape.format, shape.head_dim);
}

// Per layer: K, V, then positions, each aligned; a coded layer's parameters, scales and
// residual after them.
size_t LayerBytes(const KvCacheShape& s, int capacity) {
  const size_t heads = static_cast<size_t>(s.n_heads);
  const size_t positions = AlignUp(heads * capacity * sizeof(int32_t));
  if (!KvCoded(s.format)) {
    return 2 * AlignUp(heads * capacity * s.head_dim * DTypeSize(s.dtype)) + positions;
  }
  const CodedSizes z = CodedSizesFor(s, capacity);
  return AlignUp(heads * z.rows * z.k_row) + AlignUp(heads * z.rows * z.v_row) + positions +
         AlignUp(heads * z.groups * z.params) + AlignUp(heads * z.groups * z.scales) +
         2 * AlignUp(heads * z.resid * z.resid_row);
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
  RETURN_IF_ERROR(CheckCodedShape(shape));
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
    const size_t heads = static_cast<size_t>(shape.n_heads);
    if (KvCoded(shape.format)) {
      const CodedSizes z = CodedSizesFor(shape, c);
      uint8_t* at = p;
      l.k = Take(heads * z.rows * z.k_row, &at);
      l.v = Take(heads * z.rows * z.v_row, &at);
      l.positions = reinterpret_cast<int32_t*>(Take(heads * c * sizeof(int32_t), &at));
      PlaceCodedSide(shape, z, &at, &l);
      // Bytes: code rows and value rows of a head are z.rows rows apart.
      l.layout = kernels::KvLayout::Region(static_cast<int64_t>(z.rows * z.k_row));
      l.coding.v_layout = kernels::KvLayout::Region(static_cast<int64_t>(z.rows * z.v_row));
    } else {
      const size_t kv_bytes = AlignUp(heads * c * shape.head_dim * DTypeSize(shape.dtype));
      l.k = p;
      l.v = p + kv_bytes;
      l.positions = reinterpret_cast<int32_t*>(p + 2 * kv_bytes);
      l.layout = kernels::KvLayout::Region(l.head_stride());
    }
    p += LayerBytes(shape, c);
    cache->layers_.push_back(l);
  }
  return cache;
}

KvCache::~KvCache() = default;

namespace {

// A paged cache's bytes of K and V per token (all heads): rows in the dtype, or a coded cache's
// key code and value rows.
size_t PagedTokenBytes(const KvCacheShape& s) {
  if (!KvCoded(s.format)) {
    return 2 * static_cast<size_t>(s.n_heads) * s.head_dim * DTypeSize(s.dtype);
  }
  return static_cast<size_t>(s.n_heads) * (KvKeyCodeBytes(s.format, s.dtype, s.head_dim) +
                                           KvValueRowBytes(s.format, s.dtype, s.head_dim));
}

// Rows per head a layer of `capacity` keeps in pages: all of them, or a coded layer's code rows.
int PagedRows(const KvCacheShape& s, int capacity) {
  return KvCoded(s.format) ? CodedSizesFor(s, capacity).rows : capacity;
}

// A coded paged cache's other state, every layer's: group parameters, fp8 scales and residual,
// each aligned, in one run of the pool's pages.
size_t CodedSideBytes(const KvCacheShape& s) {
  if (!KvCoded(s.format)) return 0;
  size_t total = 0;
  const size_t heads = static_cast<size_t>(s.n_heads);
  for (int c : s.capacity) {
    const CodedSizes z = CodedSizesFor(s, c);
    total += AlignUp(heads * z.groups * z.params) + AlignUp(heads * z.groups * z.scales) +
             2 * AlignUp(heads * z.resid * z.resid_row);
  }
  return total;
}

}  // namespace

int64_t KvCache::PagedPages(const KvCacheShape& shape, size_t page_bytes) {
  const size_t token = PagedTokenBytes(shape);
  const int64_t page_tokens = static_cast<int64_t>(page_bytes / std::max<size_t>(token, 1));
  if (page_tokens == 0) return 0;
  int64_t pages = 0;
  for (int c : shape.capacity) pages += (PagedRows(shape, c) + page_tokens - 1) / page_tokens;
  const size_t side = CodedSideBytes(shape);
  return pages + static_cast<int64_t>((side + page_bytes - 1) / page_bytes);
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::CreatePaged(const KvCacheShape& shape,
                                                              KvPool& pool) {
  if (!pool.paged()) {
    return absl::FailedPreconditionError(
        "a paged KV cache needs a backend pool (KvPool::OnBackend)");
  }
  ASSIGN_OR_RETURN(const std::vector<int> blocks, PagedBlocks(shape, pool.page_bytes()));
  auto cache = std::unique_ptr<KvCache>(new KvCache());
  const size_t side = CodedSideBytes(shape);
  ASSIGN_OR_RETURN(cache->pages_, pool.AllocatePages(PagedPages(shape, pool.page_bytes()) -
                                                     static_cast<int64_t>(pool.RoundUp(side) /
                                                                          pool.page_bytes())));
  if (side > 0) {
    ASSIGN_OR_RETURN(cache->memory_, pool.Allocate(side));
  }
  const std::vector<int32_t>& ids = cache->pages_->ids();
  size_t next = 0;
  for (int b : blocks) {
    cache->tables_.emplace_back(ids.begin() + next, ids.begin() + next + b);
    next += b;
  }
  cache->LayOutPaged(shape, pool.backend(), pool.slab(), pool.page_bytes(),
                     side > 0 ? cache->memory_->data() : nullptr);
  return cache;
}

absl::StatusOr<std::vector<int>> KvCache::PagedBlocks(const KvCacheShape& shape,
                                                      size_t page_bytes) {
  if (shape.n_heads <= 0 || shape.head_dim <= 0 || shape.capacity.empty()) {
    return absl::InvalidArgumentError("KV cache shape needs heads, head_dim and layers");
  }
  for (int c : shape.capacity) {
    if (c < 0) return absl::InvalidArgumentError("KV cache capacity must be >= 0");
  }
  RETURN_IF_ERROR(CheckCodedShape(shape));
  const size_t token = PagedTokenBytes(shape);
  const int page_tokens = static_cast<int>(page_bytes / token);
  if (page_tokens == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV page of ", page_bytes, " bytes holds no token of ", shape.n_heads,
                     " heads x ", shape.head_dim, " ", DTypeName(shape.dtype), " (", token,
                     " bytes of K and V); raise --kv-page-bytes"));
  }
  std::vector<int> blocks;
  for (int c : shape.capacity)
    blocks.push_back((PagedRows(shape, c) + page_tokens - 1) / page_tokens);
  return blocks;
}

// Every layer laid out over `slab`'s pages by tables_ (FlashInfer's layout), a coded cache's
// other state from side_at on; positions in host memory of the cache's own.
void KvCache::LayOutPaged(const KvCacheShape& shape, kernels::KernelBackend* backend, uint8_t* slab,
                          size_t page_bytes, uint8_t* side_at) {
  const bool coded = KvCoded(shape.format);
  const size_t es = DTypeSize(shape.dtype);
  // A coded cache's rows are bytes: its layouts count bytes (Row(c, t, row bytes)).
  const size_t kc = coded ? KvKeyCodeBytes(shape.format, shape.dtype, shape.head_dim)
                          : static_cast<size_t>(shape.head_dim);
  const size_t unit = coded ? 1 : es;
  const int page_tokens = static_cast<int>(page_bytes / PagedTokenBytes(shape));
  shape_ = shape;
  backend_ = backend;
  page_bytes_ = page_bytes;
  int64_t positions = 0;
  for (int c : shape.capacity) positions += int64_t{shape.n_heads} * c;
  positions_.assign(positions, 0);
  int64_t at = 0;
  for (size_t i = 0; i < shape.capacity.size(); ++i) {
    const int c = shape.capacity[i];
    LayerCache l;
    l.n_heads = shape.n_heads;
    l.head_dim = shape.head_dim;
    l.dtype = shape.dtype;
    l.capacity = c;
    l.k = slab;
    l.v = slab + static_cast<size_t>(shape.n_heads) * page_tokens * kc * unit;
    if (coded) PlaceCodedSide(shape, CodedSizesFor(shape, c), &side_at, &l);
    l.positions = positions_.data() + at;
    at += int64_t{shape.n_heads} * c;
    l.layout.pages = tables_[i].data();
    l.layout.page_tokens = page_tokens;
    l.layout.heads_per_page = shape.n_heads;
    l.layout.n_heads = shape.n_heads;
    l.layout.page_stride = static_cast<int64_t>(page_bytes / unit);
    if (coded) l.coding.v_layout = l.layout;  // the same pages; V's rows follow K's in each
    layers_.push_back(l);
  }
}

absl::StatusOr<KvCache::PagedPlace> KvCache::paged_place() const {
  if (pages_ == nullptr) {
    return absl::FailedPreconditionError(
        "the cache is not in a backend pool's pages (KvCache::CreatePaged)");
  }
  PagedPlace place;
  place.page_bytes = page_bytes_;
  place.tables = tables_;
  if (memory_ != nullptr) place.side_offset = memory_->data() - layers_[0].k;
  return place;
}

absl::Status KvCache::CheckPagedPlace(const KvCacheShape& shape, size_t slab_bytes,
                                      const PagedPlace& place) {
  if (place.page_bytes == 0 || slab_bytes < place.page_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("pages of ", place.page_bytes, " bytes in a slab of ", slab_bytes));
  }
  ASSIGN_OR_RETURN(const std::vector<int> blocks, PagedBlocks(shape, place.page_bytes));
  if (place.tables.size() != blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(place.tables.size(), " page tables for ", blocks.size(), " layers"));
  }
  const int64_t pages = static_cast<int64_t>(slab_bytes / place.page_bytes);
  for (size_t l = 0; l < blocks.size(); ++l) {
    if (static_cast<int>(place.tables[l].size()) != blocks[l]) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, "'s page table lists ", place.tables[l].size(), " pages; its ",
                       shape.capacity[l], " tokens take ", blocks[l]));
    }
    for (int32_t id : place.tables[l]) {
      if (id < 0 || id >= pages) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", l, "'s page table names page ", id, " of a slab of ", pages));
      }
    }
  }
  const size_t side = CodedSideBytes(shape);
  if (side > 0 ? place.side_offset < 0 || place.side_offset % place.page_bytes != 0 ||
                     static_cast<size_t>(place.side_offset) + side > slab_bytes
               : place.side_offset != -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the coded state at offset ", place.side_offset, ": ", side,
                     " bytes that must start at a page of the slab of ", slab_bytes,
                     " (-1 when there are none)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::CreatePagedView(const KvCacheShape& shape,
                                                                  kernels::KernelBackend* backend,
                                                                  uint8_t* slab, size_t slab_bytes,
                                                                  const PagedPlace& place) {
  RETURN_IF_ERROR(CheckPagedPlace(shape, slab_bytes, place));
  const size_t side = CodedSideBytes(shape);
  auto cache = std::unique_ptr<KvCache>(new KvCache());
  cache->tables_ = place.tables;
  cache->LayOutPaged(shape, backend, slab, place.page_bytes,
                     side > 0 ? slab + place.side_offset : nullptr);
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
  if (lc.coded()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " keeps its rows coded in ", KvFormatName(lc.coding.format),
                     "; it takes the wire's blocks (WriteCodedBlock), not rows"));
  }
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
      from.shape().dtype != shape_.dtype || from.shape().format != KvFormat::kAuto) {
    return absl::InvalidArgumentError(
        "a KV cache copies from one of its shape whose rows are host memory in its dtype");
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

int64_t LayerCache::HeadBytes() const {
  if (!coded()) return int64_t{2} * len * static_cast<int64_t>(row_bytes());
  // The coded rows as the wire's blocks of them (codes, groups' parameters and scales).
  const int rows = coding.ResidBegin(len);
  return static_cast<int64_t>(
             KvKeyBlockBytes(coding.format, dtype, head_dim, coding.kept, 0, rows) +
             KvValueBlockBytes(coding.format, dtype, head_dim, coding.kept, 0, rows)) +
         (len - rows) * 2 * static_cast<int64_t>(row_bytes());
}

int64_t KvCache::StoredBytes() const {
  int64_t total = 0;
  for (const LayerCache& l : layers_) total += l.n_heads * l.HeadBytes();
  return total;
}

int KvCache::CodedRows(int layer) const {
  const LayerCache& lc = layers_[layer];
  if (lc.paged()) {
    return static_cast<int>(tables_[layer].size()) / (lc.n_heads / lc.layout.heads_per_page) *
           lc.layout.page_tokens;
  }
  return static_cast<int>(lc.layout.head_stride / static_cast<int64_t>(KvKeyCodeBytes(
                                                      lc.coding.format, lc.dtype, lc.head_dim)));
}

absl::Status KvCache::WriteCodedBlock(int layer, int head, int first, int n, const uint8_t* k,
                                      const uint8_t* v) {
  if (layer < 0 || layer >= num_layers() || !layers_[layer].coded()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is not a coded layer of this cache"));
  }
  LayerCache& lc = layers_[layer];
  const KvGroups groups{lc.coding.kept};
  if (head < 0 || head >= lc.n_heads || first < 0 || n < 1 || first + n > lc.coding.kept ||
      groups.Of(first + n - 1) >= lc.coding.max_groups || first + n > CodedRows(layer)) {
    return absl::InvalidArgumentError(
        absl::StrCat("block of tokens [", first, ", ", first + n, ") of head ", head, " of layer ",
                     layer, " is outside the cache's ", lc.coding.kept, " kept tokens"));
  }
  // Into host memory, or a device's (staged copies).
  const auto put = [&](uint8_t* dst, const uint8_t* src, size_t bytes) -> absl::Status {
    if (host_rows()) {
      std::memcpy(dst, src, bytes);
      return absl::OkStatus();
    }
    return backend_->CopyToDevice(dst, src, bytes);
  };
  const size_t kc = KvKeyCodeBytes(lc.coding.format, lc.dtype, lc.head_dim);
  const size_t vc = KvValueRowBytes(lc.coding.format, lc.dtype, lc.head_dim);
  for (int t = first; t < first + n;) {
    const int run = lc.layout.RunFrom(t, first + n);
    RETURN_IF_ERROR(
        put(lc.k + lc.layout.Row(head, t, static_cast<int>(kc)), k + (t - first) * kc, run * kc));
    RETURN_IF_ERROR(put(lc.v + lc.coding.v_layout.Row(head, t, static_cast<int>(vc)),
                        v + (t - first) * vc, run * vc));
    t += run;
  }
  // Then each group's parameters (keys) and scale (fp8 values), as the block lists them: one
  // head's groups are consecutive.
  const int g0 = groups.Of(first), g1 = groups.Of(first + n - 1);
  const size_t gb = KvKeyGroupBytes(lc.coding.format, lc.head_dim);
  RETURN_IF_ERROR(put(lc.coding.k_params + (int64_t{head} * lc.coding.max_groups + g0) * gb,
                      k + static_cast<size_t>(n) * kc, (g1 - g0 + 1) * gb));
  if (lc.coding.format == KvFormat::kFP8) {
    RETURN_IF_ERROR(put(lc.coding.v_scales + int64_t{head} * lc.coding.max_groups + g0,
                        v + static_cast<size_t>(n) * vc, g1 - g0 + 1));
  }
  return absl::OkStatus();
}

}  // namespace kvwire
