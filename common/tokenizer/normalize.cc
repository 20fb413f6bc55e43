// Unicode normalization forms C and D (UAX #15): see normalize.h. Decomposition and composition
// pairs come from unicode_tables (generated from Python's unicodedata); Hangul syllables are
// decomposed and composed by the arithmetic of Unicode 3.12.
#include "common/tokenizer/normalize.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/tokenizer/unicode_tables.h"
#include "common/tokenizer/utf8.h"

namespace kvwire::tokenizer_internal {
namespace {

constexpr char32_t kHangulSBase = 0xAC00, kHangulLBase = 0x1100, kHangulVBase = 0x1161,
                   kHangulTBase = 0x11A7;
constexpr uint32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28,
                   kHangulNCount = kHangulVCount * kHangulTCount,
                   kHangulSCount = kHangulLCount * kHangulNCount;

const unicode_tables::Decomposition* FindDecomposition(char32_t c) {
  const auto* begin = unicode_tables::kDecompositions;
  const auto* end = begin + unicode_tables::kDecompositionsSize;
  const auto* it = std::lower_bound(
      begin, end, c,
      [](const unicode_tables::Decomposition& d, char32_t v) { return d.code_point < v; });
  return (it != end && it->code_point == c) ? it : nullptr;
}

void DecomposeChar(char32_t c, std::u32string* out) {
  if (c >= kHangulSBase && c < kHangulSBase + kHangulSCount) {
    const uint32_t s = c - kHangulSBase;
    out->push_back(kHangulLBase + s / kHangulNCount);
    out->push_back(kHangulVBase + (s % kHangulNCount) / kHangulTCount);
    if (s % kHangulTCount != 0) out->push_back(kHangulTBase + s % kHangulTCount);
    return;
  }
  const unicode_tables::Decomposition* d = FindDecomposition(c);
  if (d == nullptr) {
    out->push_back(c);
    return;
  }
  DecomposeChar(d->first, out);
  const char32_t second = d->second & ~unicode_tables::kComposes;
  if (second != 0) DecomposeChar(second, out);
}

char32_t ComposePair(char32_t a, char32_t b) {
  if (a >= kHangulLBase && a < kHangulLBase + kHangulLCount && b >= kHangulVBase &&
      b < kHangulVBase + kHangulVCount) {
    return kHangulSBase + ((a - kHangulLBase) * kHangulVCount + (b - kHangulVBase)) * kHangulTCount;
  }
  if (a >= kHangulSBase && a < kHangulSBase + kHangulSCount &&
      (a - kHangulSBase) % kHangulTCount == 0 && b > kHangulTBase &&
      b < kHangulTBase + kHangulTCount) {
    return a + (b - kHangulTBase);
  }
  // (first << 21 | second) -> composite, for the pairs that are not excluded from composition.
  static const std::vector<std::pair<uint64_t, char32_t>>* const kTable = [] {
    auto* table = new std::vector<std::pair<uint64_t, char32_t>>();
    for (size_t i = 0; i < unicode_tables::kDecompositionsSize; ++i) {
      const auto& d = unicode_tables::kDecompositions[i];
      if (d.second & unicode_tables::kComposes) {
        const uint64_t second = d.second & ~unicode_tables::kComposes;
        table->emplace_back((uint64_t{d.first} << 21) | second, d.code_point);
      }
    }
    std::sort(table->begin(), table->end());
    return table;
  }();
  const uint64_t key = (uint64_t{a} << 21) | b;
  auto it = std::lower_bound(kTable->begin(), kTable->end(), std::make_pair(key, char32_t{0}));
  return (it != kTable->end() && it->first == key) ? it->second : 0;
}

}  // namespace

std::string NormalizeUnicode(std::string_view s, bool compose) {
  // Nothing below U+0300 changes under NFC, nor below U+00C0 under NFD: the usual text skips
  // the work.
  const char32_t stable_below = compose ? 0x300 : 0xC0;
  bool stable = true;
  ForEachChar(s, [&](char32_t c, size_t, size_t) { stable = stable && c < stable_below; });
  if (stable) return std::string(s);

  std::u32string d;
  ForEachChar(s, [&](char32_t c, size_t, size_t) { DecomposeChar(c, &d); });
  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < d.size();) {
    if (CombiningClass(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && CombiningClass(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + i, d.begin() + j,
                     [](char32_t x, char32_t y) { return CombiningClass(x) < CombiningClass(y); });
    i = j;
  }
  if (compose) {
    // Canonical composition: a character joins the last starter unless something between
    // them blocks it (a character of the same or a higher combining class).
    size_t starter = std::u32string::npos;
    int last_cc = -1;
    size_t out = 0;
    for (size_t i = 0; i < d.size(); ++i) {
      const char32_t c = d[i];
      const int cc = CombiningClass(c);
      if (starter != std::u32string::npos) {
        const bool adjacent = out == starter + 1;
        if (adjacent || last_cc < cc) {
          const char32_t composite = ComposePair(d[starter], c);
          if (composite != 0) {
            d[starter] = composite;
            continue;
          }
        }
      }
      if (cc == 0) starter = out;
      last_cc = cc;
      d[out++] = c;
    }
    d.resize(out);
  }
  std::string result;
  result.reserve(s.size() + 8);
  for (char32_t c : d) AppendUtf8(c, &result);
  return result;
}

}  // namespace kvwire::tokenizer_internal
