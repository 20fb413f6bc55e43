// Fuzzes config.json parsing (ModelConfig::FromJson): JSON syntax, the architecture
// families, every field's type and range, rope_scaling, eos/bos ids and Validate. A config
// it accepts is then used as the model code uses it: context limit, KV bytes per token,
// parameter count and the rotary frequencies.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "common/base/status.h"
#include "common/model/model_config.h"

namespace kvwire::fuzz {
namespace {

void Run(const uint8_t* data, size_t size) {
  auto config =
      ModelConfig::FromJson(absl::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!config.ok()) return;
  KVWIRE_CHECK(config->Validate("fuzz").ok());
  KVWIRE_CHECK(config->context_limit() > 0);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    KVWIRE_CHECK(config->KvBytesPerToken(dtype) > 0);
  }
  KVWIRE_CHECK(config->ParameterCount() > 0);
  KVWIRE_CHECK(static_cast<int>(config->RopeInvFreq().size()) == config->head_dim / 2);
}

}  // namespace
}  // namespace kvwire::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvwire::fuzz::Run(data, size);
  return 0;
}
