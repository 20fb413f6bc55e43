#include "common/base/host_alloc.h"

#include <sys/mman.h>

#include <cstdlib>

namespace kvwire {

uint8_t* AllocateHostBytes(size_t bytes) {
  constexpr size_t kLine = 64;
  bytes = ((bytes == 0 ? 1 : bytes) + kLine - 1) / kLine * kLine + kLine;
  if (bytes < kHugePageBytes) return static_cast<uint8_t*>(std::aligned_alloc(kLine, bytes));
  const size_t whole = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = std::aligned_alloc(kHugePageBytes, whole);
  // Advice only: without THP (mode "never", or no support) the memory is plain pages.
  if (p != nullptr) ::madvise(p, whole, MADV_HUGEPAGE);
  return static_cast<uint8_t*>(p);
}

}  // namespace kvwire
