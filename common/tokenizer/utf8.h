// UTF-8 for the tokenizer: encoding and decoding one character, walking a string character by
// character, validation, and Rust's String::from_utf8_lossy (one U+FFFD per maximal ill-formed
// subpart), which the byte-level and byte-fallback decoders need to match the `tokenizers`
// library byte for byte. The per-character primitives are inline because the pre-tokenizers,
// BPE and the decoder call them once per character. ReplaceAll, the substring replacement that
// the Replace normalizer, the Metaspace pre-tokenizer and the Replace decoder share, is here too.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvwire::tokenizer_internal {

inline constexpr char kReplacementUtf8[] = "\xEF\xBF\xBD";  // U+FFFD

inline void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

// What the bytes p[0..avail) start with: a well-formed UTF-8 sequence (returns its length), the
// beginning of one that is cut off (returns 0), or an ill-formed "maximal subpart" of k bytes
// (returns -k; Unicode 3.9 "U+FFFD substitution of maximal subparts", which Rust's
// String::from_utf8_lossy follows).
inline int Utf8SequenceAt(const unsigned char* p, size_t avail) {
  const unsigned char b = p[0];
  if (b < 0x80) return 1;
  int n;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b == 0xE0) {
    n = 3, lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    n = 3;
  } else if (b == 0xED) {
    n = 3, hi = 0x9F;
  } else if (b == 0xF0) {
    n = 4, lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    n = 4;
  } else if (b == 0xF4) {
    n = 4, hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k < n; ++k) {
    if (static_cast<size_t>(k) >= avail) return 0;
    const unsigned char c = p[k];
    if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return -k;
  }
  return n;
}

inline char32_t DecodeUtf8(const unsigned char* p, int len) {
  switch (len) {
    case 1:
      return p[0];
    case 2:
      return ((p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    case 3:
      return ((p[0] & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    default:
      return ((p[0] & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
  }
}

// Byte offset of the first ill-formed or cut-off sequence, or npos when `s` is valid UTF-8.
size_t FirstInvalidUtf8(std::string_view s);

// Calls f(code point, byte offset, byte length) for each character of valid UTF-8.
template <typename F>
void ForEachChar(std::string_view s, F&& f) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    int n = p[i] < 0x80 ? 1 : Utf8SequenceAt(p + i, s.size() - i);
    if (n <= 0) n = 1;  // callers pass valid UTF-8; never loop forever on bad input
    f(DecodeUtf8(p + i, n), i, static_cast<size_t>(n));
    i += n;
  }
}

std::u32string ToCodePoints(std::string_view s);

// Rust's String::from_utf8_lossy of `bytes`, appended to `out`. When `final` is false, a
// sequence cut off at the end is left for later; returns the number of bytes consumed.
size_t AppendLossy(std::string_view bytes, bool final, std::string* out);

// Whether `bytes` (a prefix of a stream) already contains an ill-formed sequence, ignoring a
// sequence cut off at the end that later bytes may complete. `*checked` is where the scan
// starts, and becomes where the next one may start (the bytes before it are well-formed).
bool HasIllFormedUtf8(std::string_view bytes, size_t* checked);

// `s` with every occurrence of `pattern` (not empty), left to right, replaced by `content`.
std::string ReplaceAll(std::string_view s, std::string_view pattern, std::string_view content);

}  // namespace kvwire::tokenizer_internal
