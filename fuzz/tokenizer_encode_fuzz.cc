// Fuzzes tokenizing with real tokenizers: Encode of arbitrary bytes, then Decode and a
// StreamingDecoder over the ids; and, in ids mode, Decode and streaming of arbitrary ids.
// Beyond the sanitizers it checks the tokenizer's promises: ids inside the vocabulary,
// every streamed delta valid UTF-8, and the deltas together equal to Decode.
//
// Input: one control byte (bits 0-3 pick the tokenizer, bit 4 add_special, bit 5
// skip_special, bit 6 ids mode), then the text (or uint16 LE ids, taken modulo the
// vocabulary). Tokenizers, in this order: the committed fixtures gpt2_bpe, llama3_bpe,
// qwen2_bpe, sp_llama2 and sp_metaspace of tests/data/tokenizers; stories260K-hf's
// tokenizer.json from $KVWIRE_SHARED_DIR/models (default: ../shared beside the checkout)
// when present; and the file named by $KVWIRE_FUZZ_TOKENIZER, if set.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/base/status.h"
#include "common/tokenizer/tokenizer.h"

namespace kvwire::fuzz {
namespace {

namespace fs = std::filesystem;

std::vector<std::unique_ptr<Tokenizer>>& Tokenizers() {
  static auto* const tokenizers = new std::vector<std::unique_ptr<Tokenizer>>();
  return *tokenizers;
}

void Load(const fs::path& path, bool required) {
  std::error_code ec;
  if (!required && !fs::exists(path, ec)) return;
  auto tok = Tokenizer::FromFile(path.string());
  if (!tok.ok()) {
    std::fprintf(stderr, "tokenizer_encode_fuzz: %s\n", tok.status().ToString().c_str());
    std::abort();
  }
  std::fprintf(stderr, "tokenizer_encode_fuzz: tokenizer %zu is %s\n", Tokenizers().size(),
               path.string().c_str());
  Tokenizers().push_back(std::move(*tok));
}

void LoadAll() {
  const fs::path source = KVWIRE_SOURCE_DIR;
  for (const char* name : {"gpt2_bpe.json", "llama3_bpe.json", "qwen2_bpe.json", "sp_llama2.json",
                           "sp_metaspace.json"}) {
    Load(source / "tests/data/tokenizers" / name, /*required=*/true);
  }
  const char* shared = std::getenv("KVWIRE_SHARED_DIR");
  const fs::path shared_dir =
      shared && *shared ? fs::path(shared) : source.parent_path() / "shared";
  Load(shared_dir / "models/stories260K-hf/tokenizer.json", /*required=*/false);
  if (const char* extra = std::getenv("KVWIRE_FUZZ_TOKENIZER"); extra && *extra) {
    Load(extra, /*required=*/true);
  }
}

// Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char b = s[i];
    int n;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b < 0x80) {
      n = 1;
    } else if (b >= 0xC2 && b <= 0xDF) {
      n = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      n = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      n = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (int k = 1; k < n; ++k) {
      const unsigned char c = s[i + k];
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return false;
    }
    i += n;
  }
  return true;
}

// Decode and the streaming decoder agree, and every delta is whole characters.
void CheckDecode(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special) {
  auto text = tok.Decode(ids, skip_special);
  KVWIRE_CHECK(text.ok());
  StreamingDecoder stream(tok, skip_special);
  std::string streamed;
  for (int32_t id : ids) {
    auto delta = stream.Push(id);
    KVWIRE_CHECK(delta.ok());
    KVWIRE_CHECK(IsValidUtf8(*delta));
    streamed += *delta;
  }
  const std::string tail = stream.Flush();
  KVWIRE_CHECK(IsValidUtf8(tail));
  streamed += tail;
  if (streamed != *text) {
    std::fprintf(stderr, "streamed %zu bytes differ from Decode's %zu\n", streamed.size(),
                 text->size());
    std::abort();
  }
}

void Run(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const auto& tokenizers = Tokenizers();
  const Tokenizer& tok = *tokenizers[(data[0] & 0x0f) % tokenizers.size()];
  const bool add_special = data[0] & 0x10, skip_special = data[0] & 0x20;
  const bool ids_mode = data[0] & 0x40;
  const absl::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  const int vocab = tok.vocab_size();

  if (ids_mode) {
    std::vector<int32_t> ids;
    for (size_t i = 0; i + 1 < rest.size(); i += 2) {
      ids.push_back((static_cast<uint8_t>(rest[i]) | static_cast<uint8_t>(rest[i + 1]) << 8) %
                    vocab);
    }
    CheckDecode(tok, ids, skip_special);
    ids.push_back(vocab);  // outside the vocabulary: an error, not a crash
    KVWIRE_CHECK(!tok.Decode(ids, skip_special).ok());
    return;
  }
  auto ids = tok.Encode(rest, add_special);
  if (!ids.ok()) return;
  for (int32_t id : *ids) KVWIRE_CHECK(id >= 0 && id < vocab);
  CheckDecode(tok, *ids, skip_special);
}

}  // namespace
}  // namespace kvwire::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  kvwire::fuzz::LoadAll();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvwire::fuzz::Run(data, size);
  return 0;
}
