#include "common/sparse/page_summaries.h"

#include <algorithm>
#include <limits>

#include "common/base/status.h"

namespace kvwire {

int PageSummaries::MaxPages(const KvCacheShape& shape, int layer, int page, int dense_layers) {
  return layer < dense_layers ? 0 : (shape.capacity[layer] + page - 1) / page;
}

PageSummaries::PageSummaries(const KvCacheShape& shape, int page, KvMemoryPtr memory,
                             int dense_layers, int tile_pages)
    : shape_(shape),
      page_(page),
      tile_pages_(tile_pages),
      memory_(std::move(memory)),
      base_(memory_->data()),
      built_(shape.capacity.size() * shape.n_heads, 0) {
  // Whole tiles are whole vectors of 8 pages: the scorers' vector and scalar parts then
  // fall where row-at-a-time code puts them.
  KVWIRE_CHECK(tile_pages_ > 0 && tile_pages_ % 8 == 0);
  size_t off = 0;
  for (size_t l = 0; l < shape.capacity.size(); ++l) {
    max_pages_.push_back(MaxPages(shape, static_cast<int>(l), page, dense_layers));
    offsets_.push_back(off);
    off += static_cast<size_t>(shape_.n_heads) * Sets(page) * shape_.head_dim * max_pages_[l] *
           DTypeSize(shape_.dtype);
  }
}

size_t PageSummaries::Bytes(const KvCacheShape& shape, int page, int dense_layers) {
  size_t total = 0;
  for (size_t l = 0; l < shape.capacity.size(); ++l) {
    total += static_cast<size_t>(shape.n_heads) * Sets(page) * shape.head_dim *
             MaxPages(shape, static_cast<int>(l), page, dense_layers) * DTypeSize(shape.dtype);
  }
  return total;
}

uint8_t* PageSummaries::MutableChunk(int layer, int head, bool max, int dim, int tile) {
  return const_cast<uint8_t*>(Chunk(layer, head, max, dim, tile));
}

float PageSummaries::Value(int layer, int head, bool max, int dim, int page) const {
  float v;
  ToFloat(shape_.dtype,
          Chunk(layer, head, max, dim, page / tile_pages_) +
              static_cast<size_t>(page % tile_pages_) * DTypeSize(shape_.dtype),
          &v, 1);
  return v;
}

// The page holding the first token not yet summarized is recomputed from its slots, and
// so is every later one: appending touches only the last page.
void PageSummaries::Update(int layer, int head, const LayerCache& lc) {
  int& built = built_[static_cast<size_t>(layer) * shape_.n_heads + head];
  if (built == lc.len) return;
  const int d = shape_.head_dim;
  const int first = built / page_;
  const int last = pages(lc.len);
  std::vector<float> lo(d), hi(d), row(d);
  const size_t es = DTypeSize(shape_.dtype);
  for (int p = first; p < last; ++p) {
    std::fill(lo.begin(), lo.end(), std::numeric_limits<float>::infinity());
    std::fill(hi.begin(), hi.end(), -std::numeric_limits<float>::infinity());
    for (int t = p * page_; t < std::min(lc.len, (p + 1) * page_); ++t) {
      ToFloat(lc.dtype, lc.k_row(head, t), row.data(), d);
      for (int i = 0; i < d; ++i) {
        lo[i] = std::min(lo[i], row[i]);
        hi[i] = std::max(hi[i], row[i]);
      }
    }
    // Min and max of values in the cache dtype are exact in it: they are stored so.
    const int tile = p / tile_pages_;
    const size_t at = static_cast<size_t>(p % tile_pages_) * es;
    for (int i = 0; i < d; ++i) {
      FromFloat(lc.dtype, &lo[i], MutableChunk(layer, head, false, i, tile) + at, 1);
      if (Sets(page_) == 2) {
        FromFloat(lc.dtype, &hi[i], MutableChunk(layer, head, true, i, tile) + at, 1);
      }
    }
  }
  built = lc.len;
}

void PageSummaries::Update(int layer, const LayerCache& lc) {
  for (int h = 0; h < lc.n_heads; ++h) Update(layer, h, lc);
}

}  // namespace kvwire
