// Page min/max summaries of one sequence's cache (RocketKV Algorithm 2 lines 1-2,
// docs/algorithms.md §3.2), read by hybrid attention and Quest. Pages are aligned to slot 0
// of the compressed cache. With pages of one token min and max are the token itself: one set
// of rows serves both. The first `dense_layers` layers (attended densely) keep none.
//
// Layout, for streaming reads, chosen by the mode that reads them: per layer and cache head,
// transposed (each head dimension's min, then max, over consecutive pages contiguous:
// [tile][dim][min, max][pages of the tile], the cache dtype), either as whole rows over every
// page (one tile: hybrid attention reads r of the 2d rows, eight at a time, each a forward
// stream) or cut into tiles of kTilePages pages (Quest reads every row: tile after tile,
// one stream through the head's summaries). Each head's summaries are its own: heads update
// and read theirs on different threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/model/kv_cache.h"
#include "kernels/selection.h"

namespace kvwire {

class PageSummaries {
 public:
  // Pages per tile: a multiple of 8, so that whole tiles are whole vectors of 8 floats.
  static constexpr int kTilePages = 64;
  // As tile_pages: one tile holds every page, each row of the transposed summary is whole.
  static constexpr int kRows = 1 << 30;

  PageSummaries(const KvCacheShape& shape, int page, KvMemoryPtr memory, int dense_layers = 0,
                int tile_pages = kRows);
  static size_t Bytes(const KvCacheShape& shape, int page, int dense_layers = 0);

  // Brings cache head `head` of `layer` up to date with the cache (call after tokens were
  // appended). Calls for different heads may run at the same time.
  void Update(int layer, int head, const LayerCache& lc);
  // Every head, one after another.
  void Update(int layer, const LayerCache& lc);
  int page() const { return page_; }
  int tile_pages() const { return tile_pages_; }
  int pages(int len) const { return (len + page_ - 1) / page_; }
  // How `layer`'s summaries are laid out (kernels/selection.h), and cache head `head`'s block.
  kernels::SummaryLayout Layout(int layer) const {
    return {shape_.head_dim, page_, tile_pages_, max_pages_[layer], shape_.dtype};
  }
  const uint8_t* HeadBlock(int layer, int head) const {
    return base_ + offsets_[layer] +
           static_cast<size_t>(head) * Layout(layer).head_elems() * DTypeSize(shape_.dtype);
  }
  float Value(int layer, int head, bool max, int dim, int page) const;

 private:
  // Rows of one page summary set per head: min and max, or one set for pages of one token.
  static int Sets(int page) { return page == 1 ? 1 : 2; }
  static int MaxPages(const KvCacheShape& shape, int layer, int page, int dense_layers);

  KvCacheShape shape_;
  int page_;
  int tile_pages_;
  KvMemoryPtr memory_;
  uint8_t* base_;  // memory_->data()
  std::vector<int> max_pages_;
  std::vector<size_t> offsets_;
  std::vector<int> built_;  // [layer · n_heads + head]: tokens summarized
};

}  // namespace kvwire
