// The byte-level map, the hand-written matchers of the known pre-tokenizer regexes, and
// NormalizedString::split (see pretokenize.h). Each regex is matched alternative by
// alternative, with the backtracking a regex engine would do, over the text's characters and
// their Unicode classes (unicode_tables.h).
#include "common/tokenizer/pretokenize.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/unicode_tables.h"
#include "common/tokenizer/utf8.h"

namespace kvwire::tokenizer_internal {

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

namespace {

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

}  // namespace

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

}  // namespace kvwire::tokenizer_internal
