// kvwire tokenize: the model's tokenizer on a text, for checking against other tools.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "common/base/status.h"
#include "tools/commands.h"

namespace kvwire::tools {

int RunTokenize(int argc, char** argv) {
  Flags flags;
  DefineModelFlags(flags);
  flags.Define("text", "", "the text to encode");
  flags.DefineBool("no-special", "do not add special tokens (BOS)");
  const char* usage = "kvwire tokenize --model DIR --text TEXT";
  if (int rc = ParseFlagsOrExit(flags, "kvwire tokenize", usage, argc, argv, 0); rc >= 0) return rc;
  auto model = LoadModelFromFlags(flags);
  if (!model.ok()) return Fail("tokenize", model.status());
  const Tokenizer& tok = (*model)->tokenizer();
  auto ids = tok.Encode(flags.GetString("text"), !flags.GetBool("no-special"));
  if (!ids.ok()) return Fail("tokenize", ids.status());
  auto text = tok.Decode(*ids);
  if (!text.ok()) return Fail("tokenize", text.status());
  const nlohmann::json out = {{"ids", *ids}, {"text", *text}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace kvwire::tools
