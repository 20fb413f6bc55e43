#include "common/sparse/page_summaries.h"

#include <algorithm>

#include "common/base/status.h"
#include "kernels/cpu/selection.h"

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

float PageSummaries::Value(int layer, int head, bool max, int dim, int page) const {
  float v;
  ToFloat(shape_.dtype,
          HeadBlock(layer, head) +
              Layout(layer).Offset(max, dim, page) * static_cast<int64_t>(DTypeSize(shape_.dtype)),
          &v, 1);
  return v;
}

// The page holding the first token not yet summarized is recomputed from its slots, and
// so is every later one: appending touches only the last page (kernels/cpu/summaries.cc).
void PageSummaries::Update(int layer, int head, const LayerCache& lc) {
  int& built = built_[static_cast<size_t>(layer) * shape_.n_heads + head];
  if (built == lc.len) return;
  kernels::SummaryUpdateSegment s;
  s.k = lc.k;
  s.kv = lc.layout;
  s.coding = lc.coding;
  s.n_heads = lc.n_heads;
  s.first = built;
  s.len = lc.len;
  s.summaries = const_cast<uint8_t*>(HeadBlock(layer, 0));
  s.layout = Layout(layer);
  kernels::cpu::UpdateHeadSummaries(s, head);
  built = lc.len;
}

void PageSummaries::Update(int layer, const LayerCache& lc) {
  for (int h = 0; h < lc.n_heads; ++h) Update(layer, h, lc);
}

}  // namespace kvwire
