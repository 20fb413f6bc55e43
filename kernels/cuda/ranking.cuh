// The ranking order of common/base/ranking.h on the device: a float maps to an unsigned key in
// the same order (−0 as +0, NaN below −∞), so that a radix sort of keys, largest first, ranks as
// BestFirst does. Keys of 64 bits put the score above the inverted index: distinct, and of
// equal scores the lower index first.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace kvwire::kernels::cuda {

__host__ __device__ __forceinline__ uint32_t OrderedBits(float s) {
  uint32_t b;
  memcpy(&b, &s, sizeof(b));
  b = (b << 1) == 0 ? 0 : b;                      // −0 as +0
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0;  // NaN below every number
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float an OrderedBits key came from (NaN's key, 0, gives −NaN's bits: only NaN maps there).
__host__ __device__ __forceinline__ float FromOrderedBits(uint32_t k) {
  const uint32_t b = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  float s;
  memcpy(&s, &b, sizeof(s));
  return s;
}

// common/base/ranking.h's BestFirstKey.
__host__ __device__ __forceinline__ uint64_t BestFirstKey(float s, int32_t i) {
  return (uint64_t{OrderedBits(s)} << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

__host__ __device__ __forceinline__ int32_t IndexOfKey(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

// `s` as a float that FlashInfer's top-k, which ranks a float by its bits, ranks as OrderedBits
// does: −0 as +0, and NaN as −∞ (no float's bits rank below −∞, and FlashInfer's coarse pass
// converts to f16, which makes every NaN the largest); a caller that must tell −∞ from NaN
// reads the score again.
__host__ __device__ __forceinline__ float StagedForFlashInfer(float s) {
  const uint32_t b = OrderedBits(s);
  return b == 0 ? -INFINITY : FromOrderedBits(b);
}

// A block of kOrderThreads orders the items FlashInfer's top-k chose (at most 2048) with each
// thread holding the fewest keys that cover `width`: 1, 2, 4 or 8, given to `launch` as a
// std::integral_constant (the kernel's template argument).
inline constexpr int kOrderThreads = 256;
template <typename Launch>
void WithOrderItems(int width, Launch&& launch) {
  if (width <= kOrderThreads) {
    launch(std::integral_constant<int, 1>{});
  } else if (width <= 2 * kOrderThreads) {
    launch(std::integral_constant<int, 2>{});
  } else if (width <= 4 * kOrderThreads) {
    launch(std::integral_constant<int, 4>{});
  } else {
    launch(std::integral_constant<int, 8>{});
  }
}

}  // namespace kvwire::kernels::cuda
