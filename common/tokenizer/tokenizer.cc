// HF tokenizer.json tokenizers. The pipeline and its corner cases follow the Rust `tokenizers`
// library (the oracle in tests/data/tokenizers/make_fixtures.py):
//
//   encode: added tokens split out of the raw text (leftmost-longest) -> normalizer on the rest
//           -> added tokens marked `normalized` split out of the normalized text
//           -> pre-tokenizer (words) -> BPE per word -> post-processor (BOS etc.)
//   decode: ids -> token strings (specials skipped) -> decoder chain -> concatenation
//
// The decoder chain is written as streaming stages (each holds back only what a later token
// could still change), and Decode is "push every id, then flush", so StreamingDecoder and
// Decode agree by construction.
#include "common/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/tokenizer/unicode_tables.h"

namespace kvwire {
namespace tokenizer_internal {
namespace {

using Json = nlohmann::json;

constexpr const char kReplacementUtf8[] = "\xEF\xBF\xBD";
// Ids at or beyond this are a corrupt file rather than a vocabulary (and would make the
// id -> token table absurdly large).
constexpr int64_t kMaxId = int64_t{1} << 24;

std::string_view AsStd(absl::string_view s) { return std::string_view(s.data(), s.size()); }

// ---------------------------------------------------------------------------------------------
// UTF-8.

void AppendUtf8(char32_t c, std::string* out) {
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
int Utf8SequenceAt(const unsigned char* p, size_t avail) {
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

char32_t DecodeUtf8(const unsigned char* p, int len) {
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

std::u32string ToCodePoints(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  ForEachChar(s, [&](char32_t c, size_t, size_t) { out.push_back(c); });
  return out;
}

// Rust's String::from_utf8_lossy of `bytes`, appended to `out`. When `final` is false, a
// sequence cut off at the end is left for later; returns the number of bytes consumed.
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

// Whether `bytes` (a prefix of a stream) already contains an ill-formed sequence, ignoring a
// sequence cut off at the end that later bytes may complete. `*checked` is where the scan
// starts, and becomes where the next one may start (the bytes before it are well-formed).
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

// ---------------------------------------------------------------------------------------------
// Unicode normalization forms C and D (UAX #15), for the NFC / NFD normalizers.

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

// ---------------------------------------------------------------------------------------------
// GPT-2's byte <-> printable character map (`bytes_to_unicode`): printable Latin-1 bytes map
// to themselves, the others to U+0100 onwards in byte order.

struct ByteLevelMap {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 0x144> char_to_byte;  // -1 where no byte maps to the character
};

const ByteLevelMap& GetByteLevelMap() {
  static const ByteLevelMap* const kMap = [] {
    auto* m = new ByteLevelMap();
    m->char_to_byte.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t c = printable ? static_cast<char32_t>(b) : next++;
      AppendUtf8(c, &m->byte_to_utf8[b]);
      m->char_to_byte[c] = static_cast<int16_t>(b);
    }
    return m;
  }();
  return *kMap;
}

std::string ToByteLevel(std::string_view s) {
  const ByteLevelMap& map = GetByteLevelMap();
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char b : s) out += map.byte_to_utf8[b];
  return out;
}

// ---------------------------------------------------------------------------------------------
// The pre-tokenizer regexes. std::regex has no \p{L}, so the known patterns are matched by
// hand, alternative by alternative, with the backtracking a regex engine would do.

enum class KnownRegex { kGpt2, kLlama3, kQwen2 };

struct KnownRegexEntry {
  const char* pattern;
  KnownRegex kind;
};

// GPT-2 (and its tiktoken spelling), Llama 3 (cl100k) and Qwen2 (digits one by one).
constexpr KnownRegexEntry kKnownRegexes[] = {
    {R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re",
     KnownRegex::kGpt2},
    {R"re('(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re",
     KnownRegex::kGpt2},
    {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re",
     KnownRegex::kLlama3},
    {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re",
     KnownRegex::kQwen2},
};

struct CharInfo {
  char32_t c;
  CharClass cls;
  bool letter() const { return cls == CharClass::kLetter; }
  bool number() const {
    return cls == CharClass::kDecimalNumber || cls == CharClass::kLetterNumber ||
           cls == CharClass::kOtherNumber;
  }
  bool space() const { return cls == CharClass::kWhiteSpace; }
  bool newline() const { return c == '\r' || c == '\n'; }
  // [^\s\p{L}\p{N}]
  bool other() const { return !space() && !letter() && !number(); }
};

// End of the whitespace alternatives `\s+(?!\S)|\s+` at i (a whitespace character): the whole
// run, less its last character when a non-space follows and the run is longer than one.
size_t MatchSpaces(const std::vector<CharInfo>& t, size_t i) {
  size_t q = i;
  while (q < t.size() && t[q].space()) ++q;
  if (q == t.size() || q - 1 == i) return q;
  return q - 1;
}

// Case folding of the contraction letters under (?i): ASCII, plus U+017F (long s), which
// Oniguruma folds to 's'.
char32_t FoldContraction(char32_t c, bool ignore_case) {
  if (!ignore_case) return c;
  if (c >= 'A' && c <= 'Z') return c - 'A' + 'a';
  if (c == 0x17F) return 's';
  return c;
}

// 's|'t|'re|'ve|'m|'ll|'d: the end of the match at i, or i.
size_t MatchContraction(const std::vector<CharInfo>& t, size_t i, bool ignore_case) {
  if (t[i].c != '\'' || i + 1 >= t.size()) return i;
  const char32_t a = FoldContraction(t[i + 1].c, ignore_case);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
  if (i + 2 < t.size()) {
    const char32_t b = FoldContraction(t[i + 2].c, ignore_case);
    if ((a == 'r' || a == 'v') && b == 'e') return i + 3;
    if (a == 'l' && b == 'l') return i + 3;
  }
  return i;
}

// The end of the match starting at t[i], or i when no alternative matches there.
size_t MatchAt(KnownRegex kind, const std::vector<CharInfo>& t, size_t i) {
  const size_t n = t.size();
  if (kind == KnownRegex::kGpt2) {
    size_t e = MatchContraction(t, i, /*ignore_case=*/false);
    if (e > i) return e;
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: without the space the class must match
    // at i, and a space is in none of the classes, so one look decides.
    const size_t k = (t[i].c == ' ' && i + 1 < n) ? i + 1 : i;
    if (t[k].letter()) {
      e = k;
      while (e < n && t[e].letter()) ++e;
      return e;
    }
    if (t[k].number()) {
      e = k;
      while (e < n && t[e].number()) ++e;
      return e;
    }
    if (t[k].other()) {
      e = k;
      while (e < n && t[e].other()) ++e;
      return e;
    }
    if (t[i].space()) return MatchSpaces(t, i);
    return i;
  }

  // Llama 3 and Qwen2.
  size_t e = MatchContraction(t, i, /*ignore_case=*/true);
  if (e > i) return e;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (t[i].letter() || (!t[i].newline() && !t[i].number() && i + 1 < n && t[i + 1].letter())) {
    e = i + 1;
    while (e < n && t[e].letter()) ++e;
    return e;
  }
  // \p{N}{1,3} (Llama 3) or \p{N} (Qwen2)
  if (t[i].number()) {
    const size_t max_digits = kind == KnownRegex::kLlama3 ? 3 : 1;
    e = i;
    while (e < n && e - i < max_digits && t[e].number()) ++e;
    return e;
  }
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  const size_t k = (t[i].c == ' ' && i + 1 < n) ? i + 1 : i;
  if (t[k].other()) {
    e = k;
    while (e < n && t[e].other()) ++e;
    while (e < n && t[e].newline()) ++e;
    return e;
  }
  if (!t[i].space()) return i;
  // \s*[\r\n]+: the greedy \s* gives back characters until [\r\n]+ can match, so the match
  // ends after the last newline of the whitespace run.
  size_t q = i;
  while (q < n && t[q].space()) ++q;
  for (size_t j = q; j > i; --j) {
    if (t[j - 1].newline()) return j;
  }
  return MatchSpaces(t, i);
}

struct Span {
  size_t start;
  size_t end;
};

// All matches, leftmost first and non-overlapping, as a regex engine's find_iter gives them,
// in byte offsets of `s`.
std::vector<Span> FindRegexMatches(KnownRegex kind, std::string_view s) {
  std::vector<CharInfo> t;
  std::vector<size_t> offsets;
  t.reserve(s.size());
  offsets.reserve(s.size() + 1);
  ForEachChar(s, [&](char32_t c, size_t offset, size_t) {
    t.push_back({c, GetCharClass(c)});
    offsets.push_back(offset);
  });
  offsets.push_back(s.size());
  std::vector<Span> matches;
  size_t i = 0;
  while (i < t.size()) {
    const size_t e = MatchAt(kind, t, i);
    if (e > i) {
      matches.push_back({offsets[i], offsets[e]});
      i = e;
    } else {
      ++i;
    }
  }
  return matches;
}

std::vector<Span> FindLiteralMatches(std::string_view literal, std::string_view s) {
  std::vector<Span> matches;
  if (literal.empty()) return matches;
  size_t pos = 0;
  while ((pos = s.find(literal, pos)) != std::string_view::npos) {
    matches.push_back({pos, pos + literal.size()});
    pos += literal.size();
  }
  return matches;
}

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// NormalizedString::split: turns the matches into the pieces to keep (byte spans of a string of
// `size` bytes), by the delimiter behaviour.
std::vector<Span> SplitSpans(size_t size, const std::vector<Span>& matches, SplitBehavior behavior,
                             bool invert) {
  struct Part {
    Span span;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t prev = 0;
  for (const Span& m : matches) {
    if (prev != m.start) parts.push_back({{prev, m.start}, invert});
    parts.push_back({m, !invert});
    prev = m.end;
  }
  if (prev != size) parts.push_back({{prev, size}, invert});

  std::vector<Span> kept;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Part& p : parts) kept.push_back(p.span);
      break;
    case SplitBehavior::kRemoved:
      for (const Part& p : parts) {
        if (!p.is_match) kept.push_back(p.span);
      }
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Part& p : parts) {
        if (p.is_match == previous_match && !kept.empty()) {
          kept.back().end = p.span.end;
        } else {
          kept.push_back(p.span);
        }
        previous_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Part& p : parts) {
        if (p.is_match && !previous_match && !kept.empty()) {
          kept.back().end = p.span.end;
        } else {
          kept.push_back(p.span);
        }
        previous_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty()) {
          kept.back().start = it->span.start;
        } else {
          kept.push_back(it->span);
        }
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
  }
  return kept;
}

// ---------------------------------------------------------------------------------------------
// Pipeline parts.

struct NormalizerStep {
  enum class Kind { kPrepend, kReplace, kStrip, kNfc, kNfd };
  Kind kind;
  std::string pattern;  // kReplace
  std::string content;  // kPrepend, kReplace
  bool strip_left = false;
  bool strip_right = false;
};

enum class PrependScheme { kAlways, kNever, kFirst };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace };
  Kind kind;
  // kSplit
  bool is_regex = false;
  KnownRegex regex = KnownRegex::kGpt2;
  std::string literal;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // kByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // kMetaspace
  char32_t replacement = 0x2581;
  std::string replacement_utf8;
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
};

// A piece of text on its way to the model. `at_start`: it begins at offset 0 of the input
// (Metaspace's prepend_scheme "first" looks at that).
struct Piece {
  std::string text;
  bool at_start;
};

struct DecoderStep {
  // kBytes (for Tokenizer::Bytes): "<0xNN>" tokens are bytes, shown as UTF-8 (lossy).
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace, kByteLevel, kBytes, kJoin };
  Kind kind;
  // Whether the stage sees one token in chunks (after Fuse or ByteLevel) rather than tokens.
  bool fused_input = false;
  std::string pattern, content;  // kReplace
  char32_t strip_char = ' ';     // kStrip
  int strip_start = 0, strip_stop = 0;
  char32_t replacement = 0x2581;  // kMetaspace
  bool strip_first = true;        // kMetaspace: prepend_scheme != never

  static DecoderStep Of(Kind kind) {
    DecoderStep step;
    step.kind = kind;
    return step;
  }
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Transparent hashing, so lookups by string_view allocate nothing.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
using StringToId = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Leftmost-longest matching of a set of strings (the added tokens), like the Aho-Corasick
// automaton the library builds; the sets are small, so candidates are bucketed by first byte.
class TokenMatcher {
 public:
  void Build(std::vector<std::pair<std::string, int>> patterns) {
    patterns_ = std::move(patterns);
    std::stable_sort(patterns_.begin(), patterns_.end(), [](const auto& a, const auto& b) {
      const unsigned char fa = a.first[0], fb = b.first[0];
      if (fa != fb) return fa < fb;
      return a.first.size() > b.first.size();
    });
    bucket_.fill({0, 0});
    for (size_t i = 0; i < patterns_.size(); ++i) {
      auto& b = bucket_[static_cast<unsigned char>(patterns_[i].first[0])];
      if (b.second == 0) b.first = static_cast<uint32_t>(i);
      ++b.second;
    }
  }
  bool empty() const { return patterns_.empty(); }
  // The leftmost-longest match at or after `from`: sets [start, end) and the pattern's tag.
  bool Find(std::string_view text, size_t from, size_t* start, size_t* end, int* tag) const {
    for (size_t i = from; i < text.size(); ++i) {
      const auto& b = bucket_[static_cast<unsigned char>(text[i])];
      for (uint32_t k = b.first; k < b.first + b.second; ++k) {
        const std::string& p = patterns_[k].first;
        if (text.compare(i, p.size(), p) == 0) {
          *start = i;
          *end = i + p.size();
          *tag = patterns_[k].second;
          return true;
        }
      }
    }
    return false;
  }

 private:
  std::vector<std::pair<std::string, int>> patterns_;
  std::array<std::pair<uint32_t, uint32_t>, 256> bucket_{};  // (first index, count)
};

struct Segment {
  size_t start, end;
  int added;  // index into added tokens, or -1 for text
};

// ---------------------------------------------------------------------------------------------
// BPE.

struct MergeInfo {
  int32_t rank;
  int32_t new_id;
};

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct BpeModel {
  StringToId vocab;
  std::unordered_map<uint64_t, MergeInfo> merges;
  std::string unk_token;  // empty: none
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
  std::array<int32_t, 256> byte_ids{};  // id of "<0xNN>", or -1

  // BPE::tokenize of one word (models/bpe/model.rs merge_word + word.rs merge_all).
  void Tokenize(std::string_view word, std::vector<int32_t>* out) const;
};

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  int32_t len;  // bytes; 0 once merged into its left neighbour
};

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&symbols](int32_t id, size_t len) {
    const int32_t n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, static_cast<int32_t>(len)});
  };
  int32_t pending_unk_len = 0;  // a pending <unk> of this many bytes (fuse_unk grows it)
  const bool decorate = !continuing_subword_prefix.empty() || !end_of_word_suffix.empty();
  std::string decorated;
  ForEachChar(word, [&](char32_t, size_t offset, size_t len) {
    std::string_view s = word.substr(offset, len);
    if (decorate) {
      decorated.clear();
      if (offset > 0) decorated += continuing_subword_prefix;
      decorated.append(s);
      if (offset + len == word.size()) decorated += end_of_word_suffix;
      s = decorated;
    }
    auto it = vocab.find(s);
    if (it != vocab.end()) {
      if (pending_unk_len > 0) {
        add(unk_id, pending_unk_len);
        pending_unk_len = 0;
      }
      add(it->second, len);
      return;
    }
    if (byte_fallback) {
      bool all = true;
      for (unsigned char b : s) all = all && byte_ids[b] >= 0;
      if (all) {
        // Like the library, a pending <unk> is not flushed first (it lands after these).
        for (unsigned char b : s) add(byte_ids[b], 1);
        return;
      }
    }
    if (unk_id >= 0) {
      if (pending_unk_len > 0 && !fuse_unk) {
        add(unk_id, pending_unk_len);
        pending_unk_len = 0;
      }
      pending_unk_len += static_cast<int32_t>(len);
    }
    // Without an unk token the character is dropped, as in the library.
  });
  if (pending_unk_len > 0) add(unk_id, pending_unk_len);

  // Merge the pair of lowest rank first (leftmost on ties) until none is left. Queue entries
  // go stale when a neighbour changes; they are recognised by re-checking the pair.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;  // std::priority_queue is a max-heap
    }
  };
  std::vector<Candidate> storage;
  storage.reserve(symbols.size());
  std::priority_queue<Candidate> queue(std::less<Candidate>(), std::move(storage));
  auto find_merge = [this](int32_t a, int32_t b) -> const MergeInfo* {
    auto it = merges.find(PairKey(a, b));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeInfo* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = symbols[next_pos];
    const MergeInfo* m = find_merge(cur.id, right.id);
    if (m == nullptr || m->new_id != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const MergeInfo* pm = find_merge(symbols[cur.prev].id, cur.id)) {
        queue.push({pm->rank, cur.prev, pm->new_id});
      }
    }
    if (cur.next >= 0) {
      if (const MergeInfo* nm = find_merge(cur.id, symbols[cur.next].id)) {
        queue.push({nm->rank, top.pos, nm->new_id});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out->push_back(s.id);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct TokenizerImpl {
  std::string source;
  int32_t vocab_size = 0;
  std::vector<std::string> id_to_token;
  std::vector<uint8_t> has_token;
  std::vector<uint8_t> is_special;

  std::vector<AddedToken> added;
  StringToId added_by_content;
  TokenMatcher raw_matcher;         // added tokens matched in the raw input
  TokenMatcher normalized_matcher;  // `normalized` ones, matched in the normalized input

  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  BpeModel model;
  std::vector<int32_t> prefix_ids;  // the post-processor's tokens before and after the text
  std::vector<int32_t> suffix_ids;
  std::vector<DecoderStep> decoders;

  std::optional<int32_t> bos;
  std::optional<int32_t> eos;

  std::string Normalize(std::string s) const;
  void PreTokenize(Piece input, std::vector<Piece>* out) const;
  std::vector<Segment> SplitAddedTokens(std::string_view text, const TokenMatcher& m) const;
  void EncodeText(std::string_view text, std::vector<int32_t>* ids) const;
};

namespace {

// HF's ends_with_word / starts_with_word / space_leftmost_at_end / space_rightmost_at_start.
bool EndsWithWordChar(std::string_view s) {
  bool word = false;
  ForEachChar(s, [&](char32_t c, size_t, size_t) { word = IsWordChar(c); });
  return word;
}
bool StartsWithWordChar(std::string_view s) {
  bool word = false, first = true;
  ForEachChar(s, [&](char32_t c, size_t, size_t) {
    if (first) word = IsWordChar(c);
    first = false;
  });
  return word;
}
// Byte offset where the trailing whitespace of `s` begins.
size_t TrailingSpaceStart(std::string_view s) {
  size_t start = 0;
  ForEachChar(s, [&](char32_t c, size_t offset, size_t len) {
    if (!IsWhiteSpace(c)) start = offset + len;
  });
  return start;
}
// Bytes of leading whitespace in `s`.
size_t LeadingSpaceLength(std::string_view s) {
  size_t length = 0;
  bool done = false;
  ForEachChar(s, [&](char32_t c, size_t offset, size_t len) {
    if (done) return;
    if (IsWhiteSpace(c)) {
      length = offset + len;
    } else {
      done = true;
    }
  });
  return length;
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

}  // namespace

std::string TokenizerImpl::Normalize(std::string s) const {
  for (const NormalizerStep& step : normalizers) {
    switch (step.kind) {
      case NormalizerStep::Kind::kPrepend:
        if (!s.empty()) s.insert(0, step.content);
        break;
      case NormalizerStep::Kind::kReplace:
        if (s.find(step.pattern) != std::string::npos)
          s = ReplaceAll(s, step.pattern, step.content);
        break;
      case NormalizerStep::Kind::kStrip: {
        size_t begin = step.strip_left ? LeadingSpaceLength(s) : 0;
        size_t end = step.strip_right ? TrailingSpaceStart(s) : s.size();
        s = end > begin ? s.substr(begin, end - begin) : std::string();
        break;
      }
      case NormalizerStep::Kind::kNfc:
      case NormalizerStep::Kind::kNfd:
        s = NormalizeUnicode(s, step.kind == NormalizerStep::Kind::kNfc);
        break;
    }
  }
  return s;
}

void TokenizerImpl::PreTokenize(Piece input, std::vector<Piece>* out) const {
  std::vector<Piece> pieces;
  if (!input.text.empty()) pieces.push_back(std::move(input));
  std::vector<Piece> next;
  auto emit_spans = [&next](const Piece& p, const std::vector<Span>& spans) {
    for (const Span& s : spans) {
      if (s.end > s.start) {
        next.push_back({p.text.substr(s.start, s.end - s.start), p.at_start && s.start == 0});
      }
    }
  };
  for (const PreTokenizerStep& step : pre_tokenizers) {
    next.clear();
    for (Piece& p : pieces) {
      switch (step.kind) {
        case PreTokenizerStep::Kind::kSplit: {
          std::vector<Span> matches = step.is_regex ? FindRegexMatches(step.regex, p.text)
                                                    : FindLiteralMatches(step.literal, p.text);
          emit_spans(p, SplitSpans(p.text.size(), matches, step.behavior, step.invert));
          break;
        }
        case PreTokenizerStep::Kind::kByteLevel: {
          if (step.add_prefix_space && p.text[0] != ' ') p.text.insert(0, " ");
          if (step.use_regex) {
            const size_t first = next.size();
            emit_spans(p, SplitSpans(p.text.size(), FindRegexMatches(KnownRegex::kGpt2, p.text),
                                     SplitBehavior::kIsolated, false));
            for (size_t i = first; i < next.size(); ++i) next[i].text = ToByteLevel(next[i].text);
          } else {
            next.push_back({ToByteLevel(p.text), p.at_start});
          }
          break;
        }
        case PreTokenizerStep::Kind::kMetaspace: {
          std::string text = p.text.find(' ') == std::string::npos
                                 ? std::move(p.text)
                                 : ReplaceAll(p.text, " ", step.replacement_utf8);
          const bool starts_with_replacement =
              text.compare(0, step.replacement_utf8.size(), step.replacement_utf8) == 0;
          if (!starts_with_replacement &&
              (step.prepend_scheme == PrependScheme::kAlways ||
               (step.prepend_scheme == PrependScheme::kFirst && p.at_start))) {
            text.insert(0, step.replacement_utf8);
          }
          Piece q{std::move(text), p.at_start};
          if (step.split) {
            // Every replacement character is a delimiter of its own, merged with what follows.
            std::vector<Span> matches;
            ForEachChar(q.text, [&](char32_t c, size_t offset, size_t len) {
              if (c == step.replacement) matches.push_back({offset, offset + len});
            });
            emit_spans(q,
                       SplitSpans(q.text.size(), matches, SplitBehavior::kMergedWithNext, false));
          } else {
            next.push_back(std::move(q));
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
  for (Piece& p : pieces) {
    if (!p.text.empty()) out->push_back(std::move(p));
  }
}

// AddedVocabulary::find_matches: segments of `text`, each an added token or plain text.
std::vector<Segment> TokenizerImpl::SplitAddedTokens(std::string_view text,
                                                     const TokenMatcher& matcher) const {
  std::vector<Segment> segments;
  if (matcher.empty()) {
    segments.push_back({0, text.size(), -1});
    return segments;
  }
  size_t start_offset = 0;
  size_t search_from = 0;
  size_t start, end;
  int tag;
  while (matcher.Find(text, search_from, &start, &end, &tag)) {
    search_from = end;  // the automaton resumes after the match, whatever happens to it
    const AddedToken& token = added[tag];
    if (token.single_word) {
      const bool start_space = start == 0 || !EndsWithWordChar(text.substr(0, start));
      const bool stop_space = end == text.size() || !StartsWithWordChar(text.substr(end));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) start = std::max(TrailingSpaceStart(text.substr(0, start)), start_offset);
    if (token.rstrip) end += LeadingSpaceLength(text.substr(end));
    if (start_offset < start) segments.push_back({start_offset, start, -1});
    segments.push_back({start, end, tag});
    start_offset = end;
  }
  if (start_offset != text.size()) segments.push_back({start_offset, text.size(), -1});
  return segments;
}

void TokenizerImpl::EncodeText(std::string_view text, std::vector<int32_t>* ids) const {
  std::vector<Piece> words;
  for (const Segment& seg : SplitAddedTokens(text, raw_matcher)) {
    if (seg.added >= 0) {
      ids->push_back(added[seg.added].id);
      continue;
    }
    std::string normalized = Normalize(std::string(text.substr(seg.start, seg.end - seg.start)));
    for (const Segment& sub : SplitAddedTokens(normalized, normalized_matcher)) {
      if (sub.added >= 0) {
        ids->push_back(added[sub.added].id);
        continue;
      }
      if (sub.end <= sub.start) continue;
      words.clear();
      PreTokenize(
          {normalized.substr(sub.start, sub.end - sub.start), seg.start == 0 && sub.start == 0},
          &words);
      for (const Piece& w : words) model.Tokenize(w.text, ids);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decoding: the decoder chain as streaming stages.

struct StageState {
  std::string buffer;         // text or bytes held back
  bool invalid_run = false;   // ByteFallback: the pending byte run is already ill-formed
  size_t checked = 0;         // ByteFallback: the well-formed prefix of the pending run
  bool passthrough = false;   // ByteFallback (fused): the token is too long to be a byte token
  int64_t tokens = 0;         // tokens seen (Metaspace, Join); leading chars stripped (Strip)
  bool leading_done = false;  // Strip (fused)
  int held = 0;               // Strip (fused): trailing strip characters held back
};

struct DecodeState {
  std::vector<StageState> stages;
  explicit DecodeState(size_t n) : stages(n) {}
};

namespace {

bool ParseByteToken(std::string_view token, unsigned char* byte) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return false;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(token[3]), lo = hex(token[4]);
  if (hi < 0 || lo < 0) return false;
  *byte = static_cast<unsigned char>(hi * 16 + lo);
  return true;
}

class DecoderRunner {
 public:
  DecoderRunner(const TokenizerImpl& impl, DecodeState* state, std::string* out)
      : steps_(impl.decoders), state_(state), out_(out) {}

  void Push(size_t stage, std::string piece) {
    if (stage == steps_.size()) {
      out_->append(piece);
      return;
    }
    const DecoderStep& step = steps_[stage];
    StageState& st = state_->stages[stage];
    const size_t next = stage + 1;
    switch (step.kind) {
      case DecoderStep::Kind::kReplace:
        if (!step.fused_input) {
          Push(next, ReplaceAll(piece, step.pattern, step.content));
        } else {
          st.buffer += piece;
          Push(next, ReplaceStreaming(step, &st.buffer));
        }
        break;
      case DecoderStep::Kind::kByteFallback:
        PushByteFallback(stage, step, &st, std::move(piece));
        break;
      case DecoderStep::Kind::kFuse:
        Push(next, std::move(piece));
        break;
      case DecoderStep::Kind::kStrip:
        if (!step.fused_input) {
          Push(next, StripToken(step, piece));
        } else {
          Push(next, StripStreaming(step, &st, piece));
        }
        break;
      case DecoderStep::Kind::kMetaspace: {
        const bool first = step.fused_input || st.tokens == 0;
        ++st.tokens;
        std::string text;
        text.reserve(piece.size());
        ForEachChar(piece, [&](char32_t c, size_t offset, size_t len) {
          if (c != step.replacement) {
            text.append(piece, offset, len);
          } else if (!(first && step.strip_first)) {
            text.push_back(' ');
          }
        });
        Push(next, std::move(text));
        break;
      }
      case DecoderStep::Kind::kByteLevel:
      case DecoderStep::Kind::kBytes:
        if (step.fused_input) {
          st.buffer += piece;  // one token: whether it maps is known only at its end
        } else {
          st.buffer += step.kind == DecoderStep::Kind::kBytes ? ByteTokenBytes(piece)
                                                              : ByteLevelBytes(piece);
          std::string text;
          st.buffer.erase(0, AppendLossy(st.buffer, /*final=*/false, &text));
          Push(next, std::move(text));
        }
        break;
      case DecoderStep::Kind::kJoin:
        if (st.tokens++ > 0) piece.insert(0, " ");
        Push(next, std::move(piece));
        break;
    }
  }

  // Releases what every stage holds, first to last, and resets the state.
  void Flush() {
    for (size_t stage = 0; stage < steps_.size(); ++stage) {
      const DecoderStep& step = steps_[stage];
      StageState& st = state_->stages[stage];
      const size_t next = stage + 1;
      switch (step.kind) {
        case DecoderStep::Kind::kReplace:
          if (!st.buffer.empty()) Push(next, std::move(st.buffer));
          break;
        case DecoderStep::Kind::kByteFallback:
          if (!step.fused_input) {
            FinishByteRun(stage, &st);
          } else if (!st.passthrough) {
            unsigned char b;
            if (ParseByteToken(st.buffer, &b)) {
              Push(next, b < 0x80 ? std::string(1, static_cast<char>(b)) : kReplacementUtf8);
            } else if (!st.buffer.empty()) {
              Push(next, std::move(st.buffer));
            }
          }
          break;
        case DecoderStep::Kind::kByteLevel:
        case DecoderStep::Kind::kBytes: {
          std::string text;
          const std::string bytes = !step.fused_input ? st.buffer
                                    : step.kind == DecoderStep::Kind::kBytes
                                        ? ByteTokenBytes(st.buffer)
                                        : ByteLevelBytes(st.buffer);
          AppendLossy(bytes, /*final=*/true, &text);
          if (!text.empty()) Push(next, std::move(text));
          break;
        }
        default:
          break;  // Strip drops its held trailing characters; the others hold nothing
      }
      st = StageState();
    }
  }

 private:
  // Replace over a stream of chunks: everything up to a possible start of the pattern.
  static std::string ReplaceStreaming(const DecoderStep& step, std::string* buffer) {
    std::string out;
    const std::string& p = step.pattern;
    size_t i = 0;
    while (i < buffer->size()) {
      const size_t left = buffer->size() - i;
      if (left >= p.size() && buffer->compare(i, p.size(), p) == 0) {
        out += step.content;
        i += p.size();
      } else if (left < p.size() && p.compare(0, left, *buffer, i, left) == 0) {
        break;  // may become the pattern once more text arrives
      } else {
        out.push_back((*buffer)[i++]);
      }
    }
    buffer->erase(0, i);
    return out;
  }

  void PushByteFallback(size_t stage, const DecoderStep& step, StageState* st, std::string piece) {
    const size_t next = stage + 1;
    if (step.fused_input) {
      if (st->passthrough) {
        Push(next, std::move(piece));
        return;
      }
      st->buffer += piece;
      if (st->buffer.size() > 6) {  // longer than "<0xNN>": never a byte token
        st->passthrough = true;
        Push(next, std::move(st->buffer));
        st->buffer.clear();
      }
      return;
    }
    unsigned char b;
    if (!ParseByteToken(piece, &b)) {
      FinishByteRun(stage, st);
      Push(next, std::move(piece));
      return;
    }
    // The library turns a whole run of byte tokens into its text if the run is valid UTF-8,
    // else into one U+FFFD per byte. A valid run must wait for its end; an ill-formed one can
    // be released at once.
    if (st->invalid_run) {
      Push(next, kReplacementUtf8);
      return;
    }
    st->buffer.push_back(static_cast<char>(b));
    if (HasIllFormedUtf8(st->buffer, &st->checked)) {
      st->invalid_run = true;
      const size_t n = st->buffer.size();
      st->buffer.clear();
      for (size_t i = 0; i < n; ++i) Push(next, kReplacementUtf8);
    }
  }

  void FinishByteRun(size_t stage, StageState* st) {
    if (!st->buffer.empty()) {
      if (FirstInvalidUtf8(st->buffer) == std::string::npos) {
        Push(stage + 1, std::move(st->buffer));
      } else {
        const size_t n = st->buffer.size();
        for (size_t i = 0; i < n; ++i) Push(stage + 1, kReplacementUtf8);
      }
      st->buffer.clear();
    }
    st->invalid_run = false;
    st->checked = 0;
  }

  // Strip of one whole token: up to `start` leading and `stop` trailing strip characters.
  static std::string StripToken(const DecoderStep& step, const std::string& token) {
    const std::u32string cps = ToCodePoints(token);
    size_t begin = 0;
    while (begin < cps.size() && begin < static_cast<size_t>(step.strip_start) &&
           cps[begin] == step.strip_char) {
      ++begin;
    }
    size_t end = cps.size();
    for (int i = 0; i < step.strip_stop && end > 0 && cps[end - 1] == step.strip_char; ++i) --end;
    std::string out;
    for (size_t i = begin; i < end; ++i) AppendUtf8(cps[i], &out);
    return out;
  }

  // Strip of the one fused token, chunk by chunk: trailing strip characters wait for Flush.
  static std::string StripStreaming(const DecoderStep& step, StageState* st,
                                    const std::string& chunk) {
    std::string out;
    ForEachChar(chunk, [&](char32_t c, size_t offset, size_t len) {
      if (!st->leading_done) {
        if (st->tokens < step.strip_start && c == step.strip_char) {
          ++st->tokens;
          return;
        }
        st->leading_done = true;
      }
      if (step.strip_stop > 0 && c == step.strip_char) {
        if (st->held < step.strip_stop) {
          ++st->held;
        } else {
          AppendUtf8(c, &out);  // the oldest held one can no longer be trailing
        }
        return;
      }
      for (; st->held > 0; --st->held) AppendUtf8(step.strip_char, &out);
      out.append(chunk, offset, len);
    });
    return out;
  }

  // The bytes a byte-level token stands for; a token with a character outside the map (an
  // added token like "<|x y|>") stands for its own UTF-8, as in the library.
  static std::string ByteLevelBytes(const std::string& token) {
    const ByteLevelMap& map = GetByteLevelMap();
    std::string bytes;
    bytes.reserve(token.size());
    bool mapped = true;
    ForEachChar(token, [&](char32_t c, size_t, size_t) {
      if (!mapped) return;
      if (c < map.char_to_byte.size() && map.char_to_byte[c] >= 0) {
        bytes.push_back(static_cast<char>(map.char_to_byte[c]));
      } else {
        mapped = false;
      }
    });
    return mapped ? bytes : token;
  }

  static std::string ByteTokenBytes(const std::string& token) {
    unsigned char b;
    return ParseByteToken(token, &b) ? std::string(1, static_cast<char>(b)) : token;
  }

  const std::vector<DecoderStep>& steps_;
  DecodeState* state_;
  std::string* out_;
};

// ---------------------------------------------------------------------------------------------
// Loading tokenizer.json.

// A JSON value for an error message: its text, cut short.
std::string Describe(const Json& j) {
  std::string s = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 60) {
    size_t cut = 57;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // whole chars
    s = s.substr(0, cut) + "...";
  }
  return s;
}

std::string Quote(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

class Loader {
 public:
  explicit Loader(std::string source) : source_(std::move(source)) {}

  absl::Status Invalid(const std::string& path, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", path, ": ", what));
  }
  absl::Status Expected(const std::string& path, const std::string& expected,
                        const Json& got) const {
    return Invalid(path, absl::StrCat("expected ", expected, ", got ", Describe(got)));
  }
  absl::Status Unsupported(const std::string& path, const std::string& what,
                           const std::string& supported) const {
    return absl::UnimplementedError(
        absl::StrCat(source_, ": ", path, ": ", what,
                     " is not supported by kvwire (supported: ", supported, ")"));
  }

  // `obj[key]`, or nullptr when absent or null.
  static const Json* Member(const Json& obj, const char* key) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }
  absl::StatusOr<const Json*> Object(const Json& j, const std::string& path) const {
    if (!j.is_object()) return Expected(path, "an object", j);
    return &j;
  }
  absl::StatusOr<std::string> String(const Json& obj, const char* key, const std::string& path,
                                     std::optional<std::string> fallback = std::nullopt) const {
    const Json* v = Member(obj, key);
    const std::string p = absl::StrCat(path, ".", key);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Invalid(p, "missing; expected a string");
    }
    if (!v->is_string()) return Expected(p, "a string", *v);
    return v->get<std::string>();
  }
  absl::StatusOr<const Json*> Array(const Json& obj, const char* key,
                                    const std::string& path) const {
    const Json* v = Member(obj, key);
    const std::string p = absl::StrCat(path, ".", key);
    if (v == nullptr) return Invalid(p, "missing; expected an array");
    if (!v->is_array()) return Expected(p, "an array", *v);
    return v;
  }
  absl::StatusOr<bool> Bool(const Json& obj, const char* key, const std::string& path,
                            bool fallback) const {
    const Json* v = Member(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return Expected(absl::StrCat(path, ".", key), "true or false", *v);
    return v->get<bool>();
  }
  absl::StatusOr<int64_t> Int(const Json& v, const std::string& path, int64_t lo,
                              int64_t hi) const {
    if (!v.is_number_integer()) return Expected(path, "an integer", v);
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(hi)
                               : (v.get<int64_t>() < lo || v.get<int64_t>() > hi)) {
      return Invalid(
          path, absl::StrCat("expected an integer in [", lo, ", ", hi, "], got ", Describe(v)));
    }
    return v.get<int64_t>();
  }
  // A single character (the Metaspace replacement, the Strip content).
  absl::StatusOr<char32_t> Char(const Json& obj, const char* key, const std::string& path,
                                std::optional<char32_t> fallback) const {
    const Json* v = Member(obj, key);
    const std::string p = absl::StrCat(path, ".", key);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Invalid(p, "missing; expected a one-character string");
    }
    if (v->is_string()) {
      const std::string s = v->get<std::string>();
      const std::u32string cps = ToCodePoints(s);
      if (cps.size() == 1) return cps[0];
    }
    return Expected(p, "a one-character string", *v);
  }
  // {"String": "..."} (or {"Regex": "..."} when regexes are allowed).
  absl::Status Pattern(const Json& obj, const std::string& path, bool* is_regex,
                       std::string* text) const {
    const Json* v = Member(obj, "pattern");
    const std::string p = absl::StrCat(path, ".pattern");
    if (v == nullptr) return Invalid(p, "missing; expected {\"String\": ...} or {\"Regex\": ...}");
    if (v->is_object() && v->size() == 1) {
      const auto it = v->begin();
      if (it.value().is_string() && (it.key() == "String" || it.key() == "Regex")) {
        *is_regex = it.key() == "Regex";
        *text = it.value().get<std::string>();
        if (text->empty()) return Invalid(p, "the pattern is empty");
        return absl::OkStatus();
      }
    }
    return Expected(p, "{\"String\": \"...\"} or {\"Regex\": \"...\"}", *v);
  }
  absl::StatusOr<PrependScheme> Scheme(const Json& obj, const std::string& path) const {
    // As the library reads it: prepend_scheme (default "always"), or the older
    // add_prefix_space, where false means "never".
    PrependScheme scheme = PrependScheme::kAlways;
    if (const Json* v = Member(obj, "prepend_scheme")) {
      const std::string s = v->is_string() ? v->get<std::string>() : "";
      if (s == "always") {
        scheme = PrependScheme::kAlways;
      } else if (s == "never") {
        scheme = PrependScheme::kNever;
      } else if (s == "first") {
        scheme = PrependScheme::kFirst;
      } else {
        return Expected(absl::StrCat(path, ".prepend_scheme"), "\"always\", \"never\" or \"first\"",
                        *v);
      }
    }
    ASSIGN_OR_RETURN(bool add_prefix_space, Bool(obj, "add_prefix_space", path, true));
    if (!add_prefix_space) {
      if (Member(obj, "prepend_scheme") != nullptr && scheme != PrependScheme::kNever) {
        return Invalid(path, "add_prefix_space false contradicts prepend_scheme");
      }
      scheme = PrependScheme::kNever;
    }
    return scheme;
  }

  absl::Status LoadModel(const Json& root, TokenizerImpl* impl);
  absl::Status LoadAddedTokens(const Json& root, TokenizerImpl* impl);
  absl::Status LoadNormalizer(const Json& j, const std::string& path, TokenizerImpl* impl);
  absl::Status LoadPreTokenizer(const Json& j, const std::string& path, TokenizerImpl* impl);
  absl::Status LoadPostProcessor(const Json& j, const std::string& path, TokenizerImpl* impl);
  absl::Status LoadDecoder(const Json& j, const std::string& path, TokenizerImpl* impl);

  // The id of a token named in the post-processor (checked against the vocabulary).
  absl::StatusOr<int32_t> ProcessorToken(const Json& j, const std::string& path,
                                         const TokenizerImpl& impl) const;

 private:
  std::string source_;
};

absl::StatusOr<std::string> TypeOf(const Loader& loader, const Json& j, const std::string& path) {
  ASSIGN_OR_RETURN(const Json* obj, loader.Object(j, path));
  return loader.String(*obj, "type", path);
}

absl::Status Loader::LoadModel(const Json& root, TokenizerImpl* impl) {
  const Json* model = Member(root, "model");
  if (model == nullptr) return Invalid("model", "missing; expected the model object");
  ASSIGN_OR_RETURN(model, Object(*model, "model"));
  std::string type;
  if (Member(*model, "type") == nullptr && Member(*model, "merges") != nullptr) {
    type = "BPE";  // the library infers it when the tag is absent
  } else {
    ASSIGN_OR_RETURN(type, String(*model, "type", "model"));
  }
  if (type != "BPE") return Unsupported("model.type", Quote(type), "BPE");

  BpeModel& bpe = impl->model;
  const Json* vocab = Member(*model, "vocab");
  if (vocab == nullptr) return Invalid("model.vocab", "missing; expected an object token -> id");
  if (!vocab->is_object()) return Expected("model.vocab", "an object token -> id", *vocab);
  std::unordered_map<int32_t, std::string> by_id;
  by_id.reserve(vocab->size());
  bpe.vocab.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const std::string path = absl::StrCat("model.vocab[", Quote(it.key()), "]");
    if (!it.value().is_number_integer()) return Expected(path, "an integer id", it.value());
    ASSIGN_OR_RETURN(int64_t id, Int(it.value(), path, 0, kMaxId - 1));
    auto [other, inserted] = by_id.emplace(static_cast<int32_t>(id), it.key());
    if (!inserted) {
      return Invalid(path, absl::StrCat("id ", id, " is also the id of ", Quote(other->second),
                                        "; expected distinct ids"));
    }
    bpe.vocab.emplace(it.key(), static_cast<int32_t>(id));
  }

  ASSIGN_OR_RETURN(bpe.unk_token, String(*model, "unk_token", "model", std::string()));
  if (!bpe.unk_token.empty()) {
    auto it = bpe.vocab.find(bpe.unk_token);
    if (it == bpe.vocab.end()) {
      return Invalid("model.unk_token",
                     absl::StrCat(Quote(bpe.unk_token), " is not in model.vocab"));
    }
    bpe.unk_id = it->second;
  }
  ASSIGN_OR_RETURN(bpe.fuse_unk, Bool(*model, "fuse_unk", "model", false));
  ASSIGN_OR_RETURN(bpe.byte_fallback, Bool(*model, "byte_fallback", "model", false));
  ASSIGN_OR_RETURN(bpe.ignore_merges, Bool(*model, "ignore_merges", "model", false));
  ASSIGN_OR_RETURN(bpe.continuing_subword_prefix,
                   String(*model, "continuing_subword_prefix", "model", std::string()));
  ASSIGN_OR_RETURN(bpe.end_of_word_suffix,
                   String(*model, "end_of_word_suffix", "model", std::string()));
  if (const Json* dropout = Member(*model, "dropout")) {
    if (!dropout->is_number()) return Expected("model.dropout", "a number or null", *dropout);
    if (dropout->get<double>() != 0.0) {
      return Unsupported("model.dropout", Describe(*dropout), "null or 0: encoding is exact");
    }
  }
  bpe.byte_ids.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = bpe.vocab.find(std::string_view(name));
    if (it != bpe.vocab.end()) bpe.byte_ids[b] = it->second;
  }

  const Json* merges = Member(*model, "merges");
  if (merges != nullptr) {
    if (!merges->is_array()) return Expected("model.merges", "an array", *merges);
    bpe.merges.reserve(merges->size());
    const std::string& prefix = bpe.continuing_subword_prefix;
    for (size_t i = 0; i < merges->size(); ++i) {
      const Json& m = (*merges)[i];
      const std::string path = absl::StrCat("model.merges[", i, "]");
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          return Expected(path, "\"a b\" or [\"a\",\"b\"]", m);
        }
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        return Expected(path, "\"a b\" or [\"a\",\"b\"]", m);
      }
      auto ia = bpe.vocab.find(a);
      if (ia == bpe.vocab.end()) {
        return Invalid(path, absl::StrCat("token ", Quote(a), " is not in model.vocab"));
      }
      auto ib = bpe.vocab.find(b);
      if (ib == bpe.vocab.end()) {
        return Invalid(path, absl::StrCat("token ", Quote(b), " is not in model.vocab"));
      }
      // The merged token drops the right part's continuing-subword prefix.
      std::string merged = a;
      merged.append(!prefix.empty() && b.compare(0, prefix.size(), prefix) == 0
                        ? b.substr(prefix.size())
                        : b);
      auto im = bpe.vocab.find(merged);
      if (im == bpe.vocab.end()) {
        return Invalid(path,
                       absl::StrCat("the merged token ", Quote(merged), " is not in model.vocab"));
      }
      // A repeated pair takes its last rank, as the library's map insertion does.
      bpe.merges[PairKey(ia->second, ib->second)] = {static_cast<int32_t>(i), im->second};
    }
  }

  int64_t max_id = -1;
  for (const auto& [id, token] : by_id) max_id = std::max<int64_t>(max_id, id);
  impl->vocab_size = static_cast<int32_t>(max_id + 1);
  impl->id_to_token.assign(impl->vocab_size, std::string());
  impl->has_token.assign(impl->vocab_size, 0);
  for (auto& [id, token] : by_id) {
    impl->id_to_token[id] = std::move(token);
    impl->has_token[id] = 1;
  }
  return absl::OkStatus();
}

absl::Status Loader::LoadAddedTokens(const Json& root, TokenizerImpl* impl) {
  impl->is_special.assign(impl->vocab_size, 0);
  const Json* list = Member(root, "added_tokens");
  if (list == nullptr) return absl::OkStatus();
  if (!list->is_array()) return Expected("added_tokens", "an array", *list);
  // The library numbers added tokens that the model lacks after the model's vocabulary, so a
  // valid id is below (model ids + added tokens).
  const int64_t id_limit = static_cast<int64_t>(impl->vocab_size) + list->size();
  std::unordered_map<int32_t, std::string> owner_of_id;
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string path = absl::StrCat("added_tokens[", i, "]");
    ASSIGN_OR_RETURN(const Json* obj, Object((*list)[i], path));
    AddedToken t;
    const Json* id = Member(*obj, "id");
    if (id == nullptr) return Invalid(path + ".id", "missing; expected an integer id");
    if (!id->is_number_integer()) return Expected(path + ".id", "an integer id", *id);
    ASSIGN_OR_RETURN(int64_t id_value, Int(*id, path + ".id", 0, kMaxId - 1));
    if (id_value >= id_limit) {
      return Invalid(path + ".id", absl::StrCat(id_value, " is out of range: expected an id below ",
                                                id_limit, " (", impl->vocab_size, " model ids + ",
                                                list->size(), " added tokens)"));
    }
    t.id = static_cast<int32_t>(id_value);
    ASSIGN_OR_RETURN(t.content, String(*obj, "content", path));
    if (t.content.empty()) return Invalid(path + ".content", "expected a non-empty string");
    if (FirstInvalidUtf8(t.content) != std::string::npos) {
      return Invalid(path + ".content", "not valid UTF-8");
    }
    ASSIGN_OR_RETURN(t.special, Bool(*obj, "special", path, false));
    ASSIGN_OR_RETURN(t.single_word, Bool(*obj, "single_word", path, false));
    ASSIGN_OR_RETURN(t.lstrip, Bool(*obj, "lstrip", path, false));
    ASSIGN_OR_RETURN(t.rstrip, Bool(*obj, "rstrip", path, false));
    ASSIGN_OR_RETURN(t.normalized, Bool(*obj, "normalized", path, !t.special));

    auto in_vocab = impl->model.vocab.find(t.content);
    if (in_vocab != impl->model.vocab.end() && in_vocab->second != t.id) {
      return Invalid(path, absl::StrCat(Quote(t.content), " has id ", t.id,
                                        " but model.vocab gives it id ", in_vocab->second));
    }
    // An added token may take over the id of a different model token: llama2.c conversions
    // (stories260K) have "\n<s>\n" at id 1 in the vocabulary and "<s>" as added token 1. The
    // library would give "<s>" a new id past the model's embeddings; the file means id 1.
    auto [prev, inserted] = impl->added_by_content.emplace(t.content, t.id);
    if (!inserted) {
      if (prev->second != t.id) {
        return Invalid(path, absl::StrCat(Quote(t.content), " is listed twice, with ids ",
                                          prev->second, " and ", t.id));
      }
      continue;
    }
    auto [owner, fresh] = owner_of_id.emplace(t.id, t.content);
    if (!fresh) {
      return Invalid(path, absl::StrCat("id ", t.id, " is given to both ", Quote(owner->second),
                                        " and ", Quote(t.content)));
    }
    impl->added.push_back(std::move(t));
  }
  // Ids of added tokens beyond the model vocabulary extend the id space.
  for (const AddedToken& t : impl->added) {
    if (t.id >= impl->vocab_size) {
      impl->vocab_size = t.id + 1;
      impl->id_to_token.resize(impl->vocab_size);
      impl->has_token.resize(impl->vocab_size, 0);
    }
  }
  impl->is_special.resize(impl->vocab_size, 0);
  for (const AddedToken& t : impl->added) {
    impl->id_to_token[t.id] = t.content;  // decoding shows the added token's text
    impl->has_token[t.id] = 1;
    if (t.special) impl->is_special[t.id] = 1;
  }
  return absl::OkStatus();
}

absl::Status Loader::LoadNormalizer(const Json& j, const std::string& path, TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  NormalizerStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "normalizers", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(
          LoadNormalizer((*list)[i], absl::StrCat(path, ".normalizers[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::kPrepend;
    ASSIGN_OR_RETURN(step.content, String(j, "prepend", path));
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::kReplace;
    bool is_regex = false;
    RETURN_IF_ERROR(Pattern(j, path, &is_regex, &step.pattern));
    if (is_regex) {
      return Unsupported(path + ".pattern", absl::StrCat("the regex ", Quote(step.pattern)),
                         "String patterns");
    }
    ASSIGN_OR_RETURN(step.content, String(j, "content", path));
  } else if (type == "Strip") {
    step.kind = NormalizerStep::Kind::kStrip;
    ASSIGN_OR_RETURN(step.strip_left, Bool(j, "strip_left", path, true));
    ASSIGN_OR_RETURN(step.strip_right, Bool(j, "strip_right", path, true));
  } else if (type == "NFC") {
    step.kind = NormalizerStep::Kind::kNfc;
  } else if (type == "NFD") {
    step.kind = NormalizerStep::Kind::kNfd;
  } else {
    return Unsupported(path + ".type", Quote(type), "Sequence, Prepend, Replace, Strip, NFC, NFD");
  }
  impl->normalizers.push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status Loader::LoadPreTokenizer(const Json& j, const std::string& path, TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  PreTokenizerStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "pretokenizers", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(
          LoadPreTokenizer((*list)[i], absl::StrCat(path, ".pretokenizers[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    std::string pattern;
    RETURN_IF_ERROR(Pattern(j, path, &step.is_regex, &pattern));
    if (step.is_regex) {
      bool known = false;
      for (const KnownRegexEntry& e : kKnownRegexes) {
        if (pattern == e.pattern) {
          step.regex = e.kind;
          known = true;
        }
      }
      if (!known) {
        return absl::UnimplementedError(absl::StrCat(
            source_, ": ", path, ".pattern: the regex ", Quote(pattern),
            " is not one kvwire knows (it matches the GPT-2, Llama 3 and Qwen2 patterns "
            "with hand-written code)"));
      }
    } else {
      step.literal = pattern;
    }
    const std::string behavior_path = path + ".behavior";
    ASSIGN_OR_RETURN(const std::string behavior, String(j, "behavior", path));
    static const std::pair<const char*, SplitBehavior> kBehaviors[] = {
        {"Removed", SplitBehavior::kRemoved},
        {"Isolated", SplitBehavior::kIsolated},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous},
    };
    bool found = false;
    for (const auto& [name, value] : kBehaviors) {
      if (behavior == name) step.behavior = value, found = true;
    }
    if (!found) {
      return Expected(behavior_path,
                      "Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous",
                      j["behavior"]);
    }
    ASSIGN_OR_RETURN(step.invert, Bool(j, "invert", path, false));
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    ASSIGN_OR_RETURN(step.add_prefix_space, Bool(j, "add_prefix_space", path, true));
    ASSIGN_OR_RETURN(step.use_regex, Bool(j, "use_regex", path, true));
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, Char(j, "replacement", path, std::nullopt));
    AppendUtf8(step.replacement, &step.replacement_utf8);
    ASSIGN_OR_RETURN(step.prepend_scheme, Scheme(j, path));
    ASSIGN_OR_RETURN(step.split, Bool(j, "split", path, true));
  } else {
    return Unsupported(path + ".type", Quote(type), "Sequence, Split, ByteLevel, Metaspace");
  }
  impl->pre_tokenizers.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<int32_t> Loader::ProcessorToken(const Json& j, const std::string& path,
                                               const TokenizerImpl& impl) const {
  ASSIGN_OR_RETURN(int64_t id, Int(j, path, 0, kMaxId - 1));
  if (id >= impl.vocab_size) {
    return Invalid(path, absl::StrCat("id ", id, " is out of range: the vocabulary has ",
                                      impl.vocab_size, " ids"));
  }
  return static_cast<int32_t>(id);
}

absl::Status Loader::LoadPostProcessor(const Json& j, const std::string& path,
                                       TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  // A processor wraps the text in `prefix` ... `suffix`; in a Sequence each wraps the result
  // of the one before.
  std::vector<int32_t> prefix, suffix;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "processors", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(
          LoadPostProcessor((*list)[i], absl::StrCat(path, ".processors[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "ByteLevel") {
    return absl::OkStatus();  // only offsets change
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const Json* v = Member(j, key);
      const std::string p = absl::StrCat(path, ".", key);
      if (v == nullptr || !v->is_array() || v->size() != 2 || !(*v)[0].is_string()) {
        return Expected(p, "[\"token\", id]", v ? *v : Json());
      }
      ASSIGN_OR_RETURN(int32_t id, ProcessorToken((*v)[1], p + "[1]", *impl));
      (std::strcmp(key, "cls") == 0 ? prefix : suffix).push_back(id);
    }
  } else if (type == "TemplateProcessing") {
    ASSIGN_OR_RETURN(const Json* single, Array(j, "single", path));
    const Json* specials = Member(j, "special_tokens");
    if (specials != nullptr && !specials->is_object()) {
      return Expected(path + ".special_tokens", "an object", *specials);
    }
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const Json& piece = (*single)[i];
      const std::string p = absl::StrCat(path, ".single[", i, "]");
      if (piece.is_object() && piece.contains("Sequence")) {
        if (seen_sequence) return Invalid(p, "a second sequence in the single template");
        seen_sequence = true;
        continue;
      }
      if (!piece.is_object() || !piece.contains("SpecialToken") ||
          !piece["SpecialToken"].is_object() || !piece["SpecialToken"].contains("id") ||
          !piece["SpecialToken"]["id"].is_string()) {
        return Expected(p, "{\"SpecialToken\": {\"id\": ...}} or {\"Sequence\": ...}", piece);
      }
      const std::string name = piece["SpecialToken"]["id"].get<std::string>();
      if (specials == nullptr || !specials->contains(name)) {
        return Invalid(
            p, absl::StrCat("special token ", Quote(name), " is not in ", path, ".special_tokens"));
      }
      const Json& entry = (*specials)[name];
      const std::string ep = absl::StrCat(path, ".special_tokens[", Quote(name), "]");
      if (!entry.is_object() || !entry.contains("ids") || !entry["ids"].is_array()) {
        return Expected(ep, "{\"ids\": [...]}", entry);
      }
      for (size_t k = 0; k < entry["ids"].size(); ++k) {
        ASSIGN_OR_RETURN(int32_t id,
                         ProcessorToken(entry["ids"][k], absl::StrCat(ep, ".ids[", k, "]"), *impl));
        (seen_sequence ? suffix : prefix).push_back(id);
      }
    }
    if (!seen_sequence) return Invalid(path + ".single", "no {\"Sequence\": ...} for the text");
  } else {
    return Unsupported(path + ".type", Quote(type),
                       "TemplateProcessing, RobertaProcessing, BertProcessing, ByteLevel, "
                       "Sequence");
  }
  impl->prefix_ids.insert(impl->prefix_ids.begin(), prefix.begin(), prefix.end());
  impl->suffix_ids.insert(impl->suffix_ids.end(), suffix.begin(), suffix.end());
  return absl::OkStatus();
}

absl::Status Loader::LoadDecoder(const Json& j, const std::string& path, TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  DecoderStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "decoders", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(LoadDecoder((*list)[i], absl::StrCat(path, ".decoders[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::kReplace;
    bool is_regex = false;
    RETURN_IF_ERROR(Pattern(j, path, &is_regex, &step.pattern));
    if (is_regex) {
      return Unsupported(path + ".pattern", absl::StrCat("the regex ", Quote(step.pattern)),
                         "String patterns");
    }
    ASSIGN_OR_RETURN(step.content, String(j, "content", path));
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::kStrip;
    ASSIGN_OR_RETURN(step.strip_char, Char(j, "content", path, std::nullopt));
    const Json* start = Member(j, "start");
    const Json* stop = Member(j, "stop");
    ASSIGN_OR_RETURN(int64_t start_value,
                     Int(start ? *start : Json(0), path + ".start", 0, 1 << 20));
    ASSIGN_OR_RETURN(int64_t stop_value, Int(stop ? *stop : Json(0), path + ".stop", 0, 1 << 20));
    step.strip_start = static_cast<int>(start_value);
    step.strip_stop = static_cast<int>(stop_value);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, Char(j, "replacement", path, std::nullopt));
    ASSIGN_OR_RETURN(PrependScheme scheme, Scheme(j, path));
    step.strip_first = scheme != PrependScheme::kNever;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::kByteLevel;
  } else {
    return Unsupported(path + ".type", Quote(type),
                       "Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip");
  }
  impl->decoders.push_back(std::move(step));
  return absl::OkStatus();
}

// After Fuse or ByteLevel the stream is one token arriving in chunks.
void MarkFusedStages(std::vector<DecoderStep>* steps) {
  bool fused = false;
  for (DecoderStep& s : *steps) {
    s.fused_input = fused;
    if (s.kind == DecoderStep::Kind::kFuse || s.kind == DecoderStep::Kind::kByteLevel) {
      fused = true;
    }
  }
}

void BuildMatchers(TokenizerImpl* impl) {
  std::vector<std::pair<std::string, int>> raw, normalized;
  for (size_t i = 0; i < impl->added.size(); ++i) {
    const AddedToken& t = impl->added[i];
    if (!t.normalized) {
      raw.emplace_back(t.content, static_cast<int>(i));
    } else {
      // Matched in normalized text, so the pattern is the normalized content.
      std::string pattern = impl->Normalize(t.content);
      if (!pattern.empty()) normalized.emplace_back(std::move(pattern), static_cast<int>(i));
    }
  }
  impl->raw_matcher.Build(std::move(raw));
  impl->normalized_matcher.Build(std::move(normalized));
}

std::optional<int32_t> FindNamed(const TokenizerImpl& impl,
                                 std::initializer_list<const char*> names) {
  for (const char* name : names) {
    auto it = impl.added_by_content.find(std::string_view(name));
    if (it != impl.added_by_content.end()) return it->second;
    auto jt = impl.model.vocab.find(std::string_view(name));
    if (jt != impl.model.vocab.end()) return jt->second;
  }
  return std::nullopt;
}

absl::StatusOr<std::unique_ptr<TokenizerImpl>> Load(std::string_view text,
                                                    const std::string& source) {
  Loader loader(source);
  Json root;
  try {
    root = Json::parse(text.begin(), text.end());
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not valid JSON (", e.what(), "); expected a tokenizer.json"));
  }
  if (!root.is_object()) return loader.Expected("(top level)", "an object", root);

  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = source;
  RETURN_IF_ERROR(loader.LoadModel(root, impl.get()));
  RETURN_IF_ERROR(loader.LoadAddedTokens(root, impl.get()));
  if (const Json* j = Loader::Member(root, "normalizer")) {
    RETURN_IF_ERROR(loader.LoadNormalizer(*j, "normalizer", impl.get()));
  }
  if (const Json* j = Loader::Member(root, "pre_tokenizer")) {
    RETURN_IF_ERROR(loader.LoadPreTokenizer(*j, "pre_tokenizer", impl.get()));
  }
  if (const Json* j = Loader::Member(root, "post_processor")) {
    RETURN_IF_ERROR(loader.LoadPostProcessor(*j, "post_processor", impl.get()));
  }
  if (const Json* j = Loader::Member(root, "decoder")) {
    RETURN_IF_ERROR(loader.LoadDecoder(*j, "decoder", impl.get()));
  } else {
    // Without a decoder the library joins the tokens with spaces.
    impl->decoders.push_back(DecoderStep::Of(DecoderStep::Kind::kJoin));
  }
  MarkFusedStages(&impl->decoders);
  BuildMatchers(impl.get());

  if (!impl->prefix_ids.empty()) {
    impl->bos = impl->prefix_ids.front();
  } else {
    impl->bos = FindNamed(*impl, {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"});
  }
  impl->eos = FindNamed(
      *impl, {"</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<eos>", "<|im_end|>"});
  return impl;
}

}  // namespace
}  // namespace tokenizer_internal

using tokenizer_internal::TokenizerImpl;

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": is a directory; expected the tokenizer.json file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    if (err == EACCES) {
      return absl::PermissionDeniedError(absl::StrCat(path, ": permission denied"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot read (", std::strerror(err), ")"));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(path, ": read error"));
  return FromJson(contents.str(), path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(absl::string_view json,
                                                               absl::string_view source_name) {
  const std::string source(source_name);
  try {
    ASSIGN_OR_RETURN(auto impl, tokenizer_internal::Load(tokenizer_internal::AsStd(json), source));
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  } catch (const std::exception& e) {
    // The loader checks types before reading values; this is a last line of defence so that
    // no exception leaves the module.
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": malformed tokenizer (", e.what(), ")"));
  }
}

std::unique_ptr<Tokenizer> Tokenizer::Bytes(int vocab_size) {
  using tokenizer_internal::AddedToken;
  using tokenizer_internal::DecoderStep;
  KVWIRE_CHECK(vocab_size >= 259);
  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = "bytes";
  impl->vocab_size = vocab_size;
  impl->id_to_token.assign(vocab_size, std::string());
  impl->has_token.assign(vocab_size, 0);
  impl->is_special.assign(vocab_size, 0);
  const char* kSpecials[] = {"<unk>", "<s>", "</s>"};
  for (int32_t id = 0; id < 3; ++id) {
    impl->id_to_token[id] = kSpecials[id];
    impl->has_token[id] = 1;
    impl->is_special[id] = 1;
    impl->model.vocab.emplace(kSpecials[id], id);
    // Recorded for TokenToId and IsSpecial, but not matched in the input: the text is bytes.
    impl->added.push_back(AddedToken{id, kSpecials[id], false, false, false, false, true});
    impl->added_by_content.emplace(kSpecials[id], id);
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    impl->id_to_token[3 + b] = name;
    impl->has_token[3 + b] = 1;
    impl->model.vocab.emplace(name, 3 + b);
    impl->model.byte_ids[b] = 3 + b;
  }
  impl->model.byte_fallback = true;
  impl->model.unk_id = 0;
  impl->model.unk_token = "<unk>";
  impl->prefix_ids = {1};
  impl->bos = 1;
  impl->eos = 2;
  // Bytes stream out as soon as they complete a character (HF's ByteFallback would hold a
  // whole run of byte tokens, which here is the whole output).
  impl->decoders = {DecoderStep::Of(DecoderStep::Kind::kBytes)};
  tokenizer_internal::MarkFusedStages(&impl->decoders);
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(absl::string_view text,
                                                       bool add_special) const {
  const std::string_view input = tokenizer_internal::AsStd(text);
  const size_t bad = tokenizer_internal::FirstInvalidUtf8(input);
  if (bad != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("Encode: the text is not valid UTF-8 at byte ", bad, " of ", input.size()));
  }
  std::vector<int32_t> ids;
  ids.reserve(input.size() / 3 + 4);
  if (add_special) ids = impl_->prefix_ids;
  impl_->EncodeText(input, &ids);
  if (add_special) ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
  return ids;
}

absl::StatusOr<std::string> Tokenizer::Decode(const std::vector<int32_t>& ids,
                                              bool skip_special) const {
  std::string out;
  tokenizer_internal::DecodeState state(impl_->decoders.size());
  tokenizer_internal::DecoderRunner runner(*impl_, &state, &out);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= impl_->vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Decode: ids[", i, "] = ", id, " is out of range [0, ", impl_->vocab_size, ")"));
    }
    if (!impl_->has_token[id] || (skip_special && impl_->is_special[id])) continue;
    runner.Push(0, impl_->id_to_token[id]);
  }
  runner.Flush();
  return out;
}

int Tokenizer::vocab_size() const { return impl_->vocab_size; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
void Tokenizer::set_eos_id(std::optional<int32_t> id) { impl_->eos = id; }

std::optional<int32_t> Tokenizer::TokenToId(absl::string_view token) const {
  const std::string_view t = tokenizer_internal::AsStd(token);
  auto it = impl_->added_by_content.find(t);
  if (it != impl_->added_by_content.end()) return it->second;
  auto jt = impl_->model.vocab.find(t);
  if (jt != impl_->model.vocab.end()) return jt->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size || !impl_->has_token[id]) return std::nullopt;
  return impl_->id_to_token[id];
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && impl_->is_special[id];
}

StreamingDecoder::StreamingDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok),
      skip_special_(skip_special),
      state_(std::make_unique<tokenizer_internal::DecodeState>(tok.impl_->decoders.size())) {}

StreamingDecoder::~StreamingDecoder() = default;

absl::StatusOr<std::string> StreamingDecoder::Push(int32_t id) {
  const TokenizerImpl& impl = *tok_.impl_;
  if (id < 0 || id >= impl.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("StreamingDecoder: id ", id, " is out of range [0, ", impl.vocab_size, ")"));
  }
  std::string out;
  if (!impl.has_token[id] || (skip_special_ && impl.is_special[id])) return out;
  tokenizer_internal::DecoderRunner runner(impl, state_.get(), &out);
  runner.Push(0, impl.id_to_token[id]);
  return out;
}

absl::Status StreamingDecoder::Prime(const std::vector<int32_t>& context) {
  for (int32_t id : context) {
    auto ignored = Push(id);
    if (!ignored.ok()) return ignored.status();
  }
  return absl::OkStatus();
}

std::string StreamingDecoder::Flush() {
  std::string out;
  tokenizer_internal::DecoderRunner runner(*tok_.impl_, state_.get(), &out);
  runner.Flush();
  return out;
}

}  // namespace kvwire
