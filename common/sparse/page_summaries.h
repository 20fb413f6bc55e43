// Page min/max summaries of one sequence's cache (RocketKV Algorithm 2 lines 1-2,
// docs/algorithms.md §3.2), read by hybrid attention and Quest: per layer and cache head,
// rows [2·d][max_pages] in the cache dtype (min rows first), transposed so that one head
// dimension over all pages is contiguous — the gather of step 2 reads r such rows. Pages
// are aligned to slot 0 of the compressed cache.
#pragma once

#include <cstdint>
#include <vector>

#include "common/model/kv_cache.h"

namespace kvwire {

class PageSummaries {
 public:
  PageSummaries(const KvCacheShape& shape, int page, KvMemoryPtr memory);
  static size_t Bytes(const KvCacheShape& shape, int page);

  // Brings `layer` up to date with the cache (call after tokens were appended).
  void Update(int layer, const LayerCache& lc);
  int page() const { return page_; }
  int pages(int len) const { return (len + page_ - 1) / page_; }
  // Dimension `dim` of the min (or max) summary of every page: max_pages elements.
  uint8_t* Row(int layer, int head, bool max, int dim);
  float Value(int layer, int head, bool max, int dim, int page);

 private:
  KvCacheShape shape_;
  int page_;
  KvMemoryPtr memory_;
  std::vector<int> max_pages_;
  std::vector<size_t> offsets_;
  std::vector<int> built_;
};

}  // namespace kvwire
