// The BPE model: the vocabulary, the ranked merges and the options of the `tokenizers` library's
// models/bpe (unk token, fuse_unk, byte_fallback, ignore_merges, continuing_subword_prefix,
// end_of_word_suffix), and BpeModel::Tokenize, which turns one pre-tokenized word into ids. The
// loader (loader.cc) fills it in from tokenizer.json's "model".
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvwire::tokenizer_internal {

// Transparent hashing, so lookups by string_view allocate nothing.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
using StringToId = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct MergeInfo {
  int32_t rank;
  int32_t new_id;
};

inline uint64_t PairKey(int32_t a, int32_t b) {
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

}  // namespace kvwire::tokenizer_internal
