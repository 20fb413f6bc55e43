#include "common/sparse/page_summaries.h"

#include <algorithm>
#include <limits>

namespace kvwire {

int PageSummaries::MaxPages(const KvCacheShape& shape, int layer, int page, int dense_layers) {
  return layer < dense_layers ? 0 : (shape.capacity[layer] + page - 1) / page;
}

PageSummaries::PageSummaries(const KvCacheShape& shape, int page, KvMemoryPtr memory,
                             int dense_layers)
    : shape_(shape), page_(page), memory_(std::move(memory)), built_(shape.capacity.size(), 0) {
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

uint8_t* PageSummaries::Row(int layer, int head, bool max, int dim) {
  const size_t row = static_cast<size_t>(max_pages_[layer]) * DTypeSize(shape_.dtype);
  const int set = Sets(page_) == 2 && max ? 1 : 0;
  return memory_->data() + offsets_[layer] +
         ((static_cast<size_t>(head) * Sets(page_) + set) * shape_.head_dim + dim) * row;
}

float PageSummaries::Value(int layer, int head, bool max, int dim, int page) {
  float v;
  ToFloat(shape_.dtype, Row(layer, head, max, dim) + page * DTypeSize(shape_.dtype), &v, 1);
  return v;
}

// The page holding the first token not yet summarized is recomputed from its slots, and
// so is every later one: appending touches only the last page.
void PageSummaries::Update(int layer, const LayerCache& lc) {
  const int d = shape_.head_dim;
  const int first = built_[layer] / page_;
  const int last = pages(lc.len);
  std::vector<float> lo(d), hi(d), row(d);
  const size_t es = DTypeSize(shape_.dtype);
  for (int h = 0; h < lc.n_heads; ++h) {
    for (int p = first; p < last; ++p) {
      std::fill(lo.begin(), lo.end(), std::numeric_limits<float>::infinity());
      std::fill(hi.begin(), hi.end(), -std::numeric_limits<float>::infinity());
      for (int t = p * page_; t < std::min(lc.len, (p + 1) * page_); ++t) {
        ToFloat(lc.dtype, lc.k_row(h, t), row.data(), d);
        for (int i = 0; i < d; ++i) {
          lo[i] = std::min(lo[i], row[i]);
          hi[i] = std::max(hi[i], row[i]);
        }
      }
      // Min and max of values in the cache dtype are exact in it: they are stored so.
      for (int i = 0; i < d; ++i) {
        FromFloat(lc.dtype, &lo[i], Row(layer, h, false, i) + p * es, 1);
        if (Sets(page_) == 2) FromFloat(lc.dtype, &hi[i], Row(layer, h, true, i) + p * es, 1);
      }
    }
  }
  built_[layer] = lc.len;
}

}  // namespace kvwire
