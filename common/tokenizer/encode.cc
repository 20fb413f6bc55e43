// The encode pipeline, TokenizerImpl's methods: added tokens are split out of the raw text
// (leftmost-longest), the normalizers run on the rest, added tokens marked `normalized` are
// split out of the normalized text, the pre-tokenizers cut it into words, and the BPE model
// turns each word into ids. The post-processor's tokens are added by Tokenizer::Encode.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/tokenizer/normalize.h"
#include "common/tokenizer/pretokenize.h"
#include "common/tokenizer/tokenizer_impl.h"
#include "common/tokenizer/unicode_tables.h"
#include "common/tokenizer/utf8.h"

namespace kvwire::tokenizer_internal {
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
          // insert(0, 1, ' '), not insert(0, " "): GCC 12 gives a false -Wrestrict for that.
          if (step.add_prefix_space && p.text[0] != ' ') p.text.insert(0, 1, ' ');
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

}  // namespace kvwire::tokenizer_internal
