// Page min/max summaries of one sequence's cache (RocketKV Algorithm 2 lines 1-2,
// docs/algorithms.md §3.2), read by hybrid attention and Quest: per layer and cache head,
// rows [2·d][max_pages] in the cache dtype (min rows first), transposed so that one head
// dimension over all pages is contiguous — the gather of step 2 reads r such rows. Pages
// are aligned to slot 0 of the compressed cache. With pages of one token min and max are the
// token itself: one set of rows serves both. The first `dense_layers` layers (attended densely)
// keep none.
#pragma once

#include <cstdint>
#include <vector>

#include "common/model/kv_cache.h"

namespace kvwire {

class PageSummaries {
 public:
  PageSummaries(const KvCacheShape& shape, int page, KvMemoryPtr memory, int dense_layers = 0);
  static size_t Bytes(const KvCacheShape& shape, int page, int dense_layers = 0);

  // Brings `layer` up to date with the cache (call after tokens were appended).
  void Update(int layer, const LayerCache& lc);
  int page() const { return page_; }
  int pages(int len) const { return (len + page_ - 1) / page_; }
  // Dimension `dim` of the min (or max) summary of every page: max_pages elements.
  uint8_t* Row(int layer, int head, bool max, int dim);
  float Value(int layer, int head, bool max, int dim, int page);

 private:
  // Rows of one page summary set per head: min and max, or one set for pages of one token.
  static int Sets(int page) { return page == 1 ? 1 : 2; }
  static int MaxPages(const KvCacheShape& shape, int layer, int page, int dense_layers);

  KvCacheShape shape_;
  int page_;
  KvMemoryPtr memory_;
  std::vector<int> max_pages_;
  std::vector<size_t> offsets_;
  std::vector<int> built_;
};

}  // namespace kvwire
