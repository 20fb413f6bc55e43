// Hugging Face `tokenizer.json` tokenizers (the `tokenizers` library's format), in C++.
//
// Supported, with the same ids as the `tokenizers` library (tests/data/tokenizers/ holds the
// oracle cases):
//   model          BPE (merges as "a b" or ["a", "b"]; byte_fallback, fuse_unk, ignore_merges,
//                  continuing_subword_prefix, end_of_word_suffix)
//   normalizer     Sequence, Prepend, Replace (string pattern), Strip, NFC, NFD
//   pre_tokenizer  Sequence, ByteLevel, Metaspace, Split (string patterns, and the GPT-2,
//                  Llama 3 and Qwen2 regexes, matched by hand-written code)
//   post_processor TemplateProcessing, RobertaProcessing, BertProcessing, ByteLevel, Sequence
//   decoder        Sequence, ByteLevel, Metaspace, Replace (string pattern), ByteFallback, Fuse,
//                  Strip
//   added_tokens   special / normalized / lstrip / rstrip / single_word
// Anything else is an UnimplementedError that names it; a malformed file is an
// InvalidArgumentError that names the file, the field and what was expected.
//
// Deliberate differences from the library: `truncation` and `padding` are ignored (a server
// must not cut prompts silently); BPE dropout is not supported; Decode rejects ids outside
// [0, vocab_size()) instead of dropping them; and an added token keeps the id the file gives
// it even where model.vocab has another token at that id (llama2.c conversions such as
// stories260K put "\n<s>\n" at id 1 and list "<s>" as added token 1; the library would
// renumber "<s>" past the model's vocabulary).
//
// A Tokenizer is immutable once loaded (except set_eos_id): Encode and Decode may run
// concurrently from many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire {

namespace tokenizer_internal {
struct TokenizerImpl;
struct DecodeState;
}  // namespace tokenizer_internal

class Tokenizer {
 public:
  // Reads tokenizer.json (HF `tokenizers` format). A missing file is NotFound.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);
  // `source_name` names the input in error messages (usually the file name).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(absl::string_view json,
                                                             absl::string_view source_name);
  // A tokenizer for synthetic models with no tokenizer.json: ids 0, 1, 2 are <unk>, <s>, </s>,
  // ids 3..258 the 256 byte values, and ids up to vocab_size (>= 259) are unused. Text is
  // encoded as its UTF-8 bytes (BOS prepended when add_special); special-token text in the
  // input is not recognised. vocab_size < 259 is a programming error (checked).
  static std::unique_ptr<Tokenizer> Bytes(int vocab_size);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Like HF `encode(text, add_special_tokens=add_special).ids`. Text that is not valid UTF-8
  // is an InvalidArgumentError.
  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text,
                                              bool add_special = true) const;
  // Like HF `decode(ids, skip_special_tokens=skip_special)`. Ids outside [0, vocab_size())
  // are an InvalidArgumentError; ids inside it that name no token (holes) decode to nothing.
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                     bool skip_special = true) const;

  // One more than the largest id of the model vocabulary and the added tokens.
  int vocab_size() const;
  // From the post-processor (the special token it puts first), else a token named like a BOS.
  std::optional<int32_t> bos_id() const;
  // A token named like an EOS ("</s>", "<|end_of_text|>", "<|endoftext|>", ...), unless set.
  std::optional<int32_t> eos_id() const;
  // config.json / generation_config.json know better than the tokenizer; they override here.
  void set_eos_id(std::optional<int32_t> id);
  // Added tokens first, then the model vocabulary (as HF `token_to_id`).
  std::optional<int32_t> TokenToId(absl::string_view token) const;
  // The token's text, if the id names one.
  std::optional<std::string> IdToToken(int32_t id) const;
  // Whether the id is a special added token (skipped by Decode when skip_special).
  bool IsSpecial(int32_t id) const;

 private:
  friend class StreamingDecoder;
  explicit Tokenizer(std::unique_ptr<tokenizer_internal::TokenizerImpl> impl);

  std::unique_ptr<tokenizer_internal::TokenizerImpl> impl_;
};

// Turns a stream of generated ids into text deltas that never split a UTF-8 character
// (byte-fallback tokens <0xE2><0x82><0xAC> arrive one by one) and that apply the decoder's
// first-token rules (e.g. the leading-space Strip) exactly as Decode of the whole sequence
// would: the concatenation of all Push() results and Flush() equals Decode(all ids). To keep
// that promise, text is held back while a later token could still change it (an unfinished
// run of byte tokens, a trailing character that a Strip may remove).
class StreamingDecoder {
 public:
  // `tok` must outlive the decoder.
  explicit StreamingDecoder(const Tokenizer& tok, bool skip_special = true);
  ~StreamingDecoder();
  StreamingDecoder(const StreamingDecoder&) = delete;
  StreamingDecoder& operator=(const StreamingDecoder&) = delete;

  // The text that `id` completes (often empty while bytes are pending). An id outside
  // [0, vocab_size()) is an InvalidArgumentError and leaves the state unchanged.
  absl::StatusOr<std::string> Push(int32_t id);
  // Whatever is left (incomplete UTF-8 becomes U+FFFD like HF). The decoder then starts over.
  std::string Flush();
  // Feeds the prompt's ids without emitting their text, so that rules that depend on the
  // position in the whole sequence (the leading-space Strip of the first token) apply to
  // the prompt, not to the first generated token. Out-of-range ids are errors.
  absl::Status Prime(const std::vector<int32_t>& context);

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::unique_ptr<tokenizer_internal::DecodeState> state_;
};

}  // namespace kvwire
