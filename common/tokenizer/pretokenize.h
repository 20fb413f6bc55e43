// Pre-tokenization building blocks: GPT-2's byte-level map (used by the ByteLevel
// pre-tokenizer and, backwards, by the ByteLevel decoder), the known pre-tokenizer regexes
// (GPT-2, Llama 3, Qwen2), which are matched by hand-written code because std::regex has no
// \p{L}, and NormalizedString::split's delimiter behaviours, which turn matches into pieces. The
// Split / ByteLevel / Metaspace steps that use them run in TokenizerImpl::PreTokenize
// (encode.cc).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvwire::tokenizer_internal {

// ---------------------------------------------------------------------------------------------
// GPT-2's byte <-> printable character map (`bytes_to_unicode`): printable Latin-1 bytes map
// to themselves, the others to U+0100 onwards in byte order.

struct ByteLevelMap {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 0x144> char_to_byte;  // -1 where no byte maps to the character
};

const ByteLevelMap& GetByteLevelMap();

// Each byte of `s` as its byte-level character.
std::string ToByteLevel(std::string_view s);

// ---------------------------------------------------------------------------------------------
// The pre-tokenizer regexes. std::regex has no \p{L}, so the known patterns are matched by
// hand, alternative by alternative, with the backtracking a regex engine would do.

enum class KnownRegex { kGpt2, kLlama3, kQwen2 };

struct KnownRegexEntry {
  const char* pattern;
  KnownRegex kind;
};

// GPT-2 (and its tiktoken spelling), Llama 3 (cl100k) and Qwen2 (digits one by one).
inline constexpr KnownRegexEntry kKnownRegexes[] = {
    {R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re",
     KnownRegex::kGpt2},
    {R"re('(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re",
     KnownRegex::kGpt2},
    {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re",
     KnownRegex::kLlama3},
    {R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re",
     KnownRegex::kQwen2},
};

// A byte range [start, end) of a string.
struct Span {
  size_t start;
  size_t end;
};

// All matches, leftmost first and non-overlapping, as a regex engine's find_iter gives them,
// in byte offsets of `s`.
std::vector<Span> FindRegexMatches(KnownRegex kind, std::string_view s);

// The non-overlapping occurrences of `literal` in `s`, leftmost first (none when it is empty).
std::vector<Span> FindLiteralMatches(std::string_view literal, std::string_view s);

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// NormalizedString::split: turns the matches into the pieces to keep (byte spans of a string of
// `size` bytes), by the delimiter behaviour.
std::vector<Span> SplitSpans(size_t size, const std::vector<Span>& matches, SplitBehavior behavior,
                             bool invert);

}  // namespace kvwire::tokenizer_internal
