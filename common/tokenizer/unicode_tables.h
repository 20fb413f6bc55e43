// Unicode properties the tokenizer needs, as sorted range tables generated from Python's
// unicodedata by tools/gen_unicode_tables.py (see common/unicode_tables.cc for the version).
// Lookups are binary searches: the tables are a few thousand entries.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kvwire {

// One class per code point; White_Space wins over the general category (the spaces are Zs, Zl,
// Zp or Cc), the rest follows the general category.
enum class CharClass : uint8_t {
  kOther = 0,
  kLetter = 1,         // L*
  kMark = 2,           // M*
  kDecimalNumber = 3,  // Nd
  kLetterNumber = 4,   // Nl
  kOtherNumber = 5,    // No
  kConnector = 6,      // Pc
  kWhiteSpace = 7,     // the White_Space property
};

namespace unicode_tables {

struct Decomposition {
  uint32_t code_point;
  uint32_t first;
  uint32_t second;  // 0 for a singleton; kComposes set when (first, second) composes back
};
constexpr uint32_t kComposes = 1u << 31;

extern const char kUnicodeVersion[];
extern const uint32_t kCharClassRuns[];  // (first code point << 8) | CharClass
extern const size_t kCharClassRunsSize;
extern const uint32_t kCombiningClassRuns[];  // (first code point << 8) | ccc
extern const size_t kCombiningClassRunsSize;
extern const Decomposition kDecompositions[];  // sorted by code point; Hangul excluded
extern const size_t kDecompositionsSize;

// The value of the run that contains `c` in a table of (first << 8 | value) entries.
inline uint8_t RunValue(const uint32_t* runs, size_t size, char32_t c) {
  const uint32_t key = (static_cast<uint32_t>(c) << 8) | 0xFF;
  const uint32_t* it = std::upper_bound(runs, runs + size, key);
  return it == runs ? 0 : static_cast<uint8_t>(*(it - 1) & 0xFF);
}

}  // namespace unicode_tables

inline CharClass GetCharClass(char32_t c) {
  if (c < 0x80) {
    // ASCII is most of the text; skip the search.
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CharClass::kLetter;
    if (c >= '0' && c <= '9') return CharClass::kDecimalNumber;
    if (c == ' ' || (c >= 0x09 && c <= 0x0D)) return CharClass::kWhiteSpace;
    if (c == '_') return CharClass::kConnector;
    return CharClass::kOther;
  }
  if (c > 0x10FFFF) return CharClass::kOther;
  return static_cast<CharClass>(unicode_tables::RunValue(unicode_tables::kCharClassRuns,
                                                         unicode_tables::kCharClassRunsSize, c));
}

// \p{L}
inline bool IsLetter(char32_t c) { return GetCharClass(c) == CharClass::kLetter; }
// \p{N}
inline bool IsNumber(char32_t c) {
  CharClass k = GetCharClass(c);
  return k == CharClass::kDecimalNumber || k == CharClass::kLetterNumber ||
         k == CharClass::kOtherNumber;
}
// \s in Oniguruma and Rust's char::is_whitespace: the White_Space property.
inline bool IsWhiteSpace(char32_t c) { return GetCharClass(c) == CharClass::kWhiteSpace; }
// \w of Rust's regex crate (alphabetic, marks, decimal digits, connector punctuation,
// join controls), with letters and letter numbers standing in for Alphabetic.
inline bool IsWordChar(char32_t c) {
  switch (GetCharClass(c)) {
    case CharClass::kLetter:
    case CharClass::kMark:
    case CharClass::kDecimalNumber:
    case CharClass::kLetterNumber:
    case CharClass::kConnector:
      return true;
    default:
      return c == 0x200C || c == 0x200D;
  }
}

// Canonical_Combining_Class (0 for starters).
inline uint8_t CombiningClass(char32_t c) {
  if (c < 0x300 || c > 0x10FFFF) return 0;
  return unicode_tables::RunValue(unicode_tables::kCombiningClassRuns,
                                  unicode_tables::kCombiningClassRunsSize, c);
}

}  // namespace kvwire
