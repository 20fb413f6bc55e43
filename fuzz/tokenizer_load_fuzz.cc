// Fuzzes loading tokenizer.json (Tokenizer::FromJson): the model (BPE vocab and merges),
// normalizers, pre-tokenizers, post-processors, decoders and added tokens. A tokenizer it
// accepts then encodes a few fixed texts and decodes ids across its vocabulary, so that the
// pipeline the file describes runs, not only its parser.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/base/status.h"
#include "common/tokenizer/tokenizer.h"

namespace kvwire::fuzz {
namespace {

void Run(const uint8_t* data, size_t size) {
  auto tok = Tokenizer::FromJson(absl::string_view(reinterpret_cast<const char*>(data), size),
                                 "fuzz.json");
  if (!tok.ok()) return;
  const Tokenizer& t = **tok;
  const int vocab = t.vocab_size();
  KVWIRE_CHECK(vocab >= 0);
  for (absl::string_view text : {"", "Hello world", " a  b\n\tc ", "héllo <s> wörld 123!",
                                 "\xE2\x82\xAC\xF0\x9F\x98\x80 \xE6\x97\xA5\xE6\x9C\xAC"}) {
    for (bool add_special : {false, true}) {
      auto ids = t.Encode(text, add_special);
      if (!ids.ok()) continue;
      for (int32_t id : *ids) KVWIRE_CHECK(id >= 0 && id < vocab);
      (void)t.Decode(*ids);
    }
  }
  // A few ids from each end of the vocabulary, one at a time and together.
  std::vector<int32_t> ids;
  for (int id = 0; id < vocab && id < 8; ++id) ids.push_back(id);
  for (int id = vocab - 1; id >= 8 && id >= vocab - 8; --id) ids.push_back(id);
  for (int32_t id : ids) {
    (void)t.IdToToken(id);
    (void)t.IsSpecial(id);
    (void)t.Decode({id}, false);
  }
  (void)t.Decode(ids, false);
  (void)t.Decode(ids, true);
  KVWIRE_CHECK(!t.Decode({vocab}).ok());
  (void)t.bos_id();
  (void)t.eos_id();
}

}  // namespace
}  // namespace kvwire::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvwire::fuzz::Run(data, size);
  return 0;
}
