// The tokenizer's internals shared by its source files: the steps of the pipeline as loaded
// from tokenizer.json (normalizer, pre-tokenizer and decoder steps, added tokens and their
// matcher) and TokenizerImpl, which holds a loaded tokenizer. Where the parts live:
// utf8.h (UTF-8), normalize.h (NFC / NFD), pretokenize.h (byte-level map, regexes, split),
// bpe.h (the model), encode.cc (TokenizerImpl's encode pipeline), decoder.h (the streaming
// decoder chain), loader.cc (tokenizer.json), tokenizer.cc (the public API of tokenizer.h).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tokenizer/bpe.h"
#include "common/tokenizer/pretokenize.h"

namespace kvwire::tokenizer_internal {

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
// The loaded tokenizer. Immutable once loaded, except `eos` (Tokenizer::set_eos_id). The encode
// methods are in encode.cc.

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

// Parses tokenizer.json text (loader.cc); `source` names it in error messages.
absl::StatusOr<std::unique_ptr<TokenizerImpl>> Load(std::string_view text,
                                                    const std::string& source);

// After Fuse or ByteLevel the stream is one token arriving in chunks.
void MarkFusedStages(std::vector<DecoderStep>* steps);

}  // namespace kvwire::tokenizer_internal
