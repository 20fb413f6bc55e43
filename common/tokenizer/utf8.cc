// The out-of-line UTF-8 routines of utf8.h: validation (FirstInvalidUtf8, HasIllFormedUtf8), the
// lossy conversion of Rust's String::from_utf8_lossy (AppendLossy), decoding to code points,
// and ReplaceAll.
#include "common/tokenizer/utf8.h"

#include <cstddef>
#include <string>
#include <string_view>

namespace kvwire::tokenizer_internal {

size_t FirstInvalidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const int n = Utf8SequenceAt(p + i, s.size() - i);
    if (n <= 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::u32string ToCodePoints(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  ForEachChar(s, [&](char32_t c, size_t, size_t) { out.push_back(c); });
  return out;
}

size_t AppendLossy(std::string_view bytes, bool final, std::string* out) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = 0;
  while (i < bytes.size()) {
    const int n = Utf8SequenceAt(p + i, bytes.size() - i);
    if (n > 0) {
      out->append(bytes.data() + i, n);
      i += n;
    } else if (n < 0) {
      out->append(kReplacementUtf8);
      i += -n;
    } else if (final) {
      out->append(kReplacementUtf8);  // a cut-off sequence is one maximal subpart
      i = bytes.size();
    } else {
      break;
    }
  }
  return i;
}

bool HasIllFormedUtf8(std::string_view bytes, size_t* checked) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t i = *checked;
  while (i < bytes.size()) {
    const int n = Utf8SequenceAt(p + i, bytes.size() - i);
    if (n < 0) return true;
    if (n == 0) break;
    i += n;
  }
  *checked = i;
  return false;
}

std::string ReplaceAll(std::string_view s, std::string_view pattern, std::string_view content) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(pattern, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(content);
    pos = hit + pattern.size();
  }
  out.append(s.substr(pos));
  return out;
}

}  // namespace kvwire::tokenizer_internal
