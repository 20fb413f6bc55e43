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
//
// This file is the public API of tokenizer.h; tokenizer_impl.h says where the parts live.
#include "common/tokenizer/tokenizer.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/tokenizer/decoder.h"
#include "common/tokenizer/tokenizer_impl.h"
#include "common/tokenizer/utf8.h"

namespace kvwire {
namespace tokenizer_internal {
namespace {

std::string_view AsStd(absl::string_view s) { return std::string_view(s.data(), s.size()); }

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
