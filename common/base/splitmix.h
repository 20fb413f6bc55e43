// SplitMix64 (Steele, Lea and Flood 2014): one step of the generator, a cheap 64-bit mix whose
// consecutive inputs land far apart. Synthetic weights and random positions draw from it; the
// prefix cache's keys and the prefill router's ring hash with it (stable across processes of
// one build, which is what they need).
#pragma once

#include <cstdint>

namespace kvwire {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace kvwire
