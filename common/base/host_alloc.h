// Large host buffers: KV rows, page summaries, and the weights and activations of the host
// backends.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvwire {

// 64-byte aligned (vector loads; threads off each other's cache lines), with one cache line
// readable past the end (a vector load that starts in the last row stays inside), or
// nullptr when none is left. From kHugePageBytes up the block is aligned to 2 MiB and advised
// as a transparent-huge-page candidate (madvise MADV_HUGEPAGE, which Debian's default THP
// mode, "madvise", requires). Streams of gigabytes (a decode step's weights) and short runs
// scattered over a large cache (sparse decode) both pay on 4 KiB pages: a TLB walk at every
// page boundary, where the hardware prefetcher's stream also stops. Release with std::free.
constexpr size_t kHugePageBytes = size_t{2} << 20;
uint8_t* AllocateHostBytes(size_t bytes);

}  // namespace kvwire
