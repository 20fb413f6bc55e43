// Fuzzes the safetensors reader (SafetensorsFile::FromBytes, the parser behind Open): the
// 8-byte header length, the JSON header, every tensor's dtype, shape and data_offsets, and
// the overlap check. A file it accepts must describe tensors that lie inside it, each
// numel · element size bytes long; the fuzzer reads their first and last bytes (ASan
// reports a view that points outside the buffer).
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/base/status.h"
#include "common/model/safetensors.h"

namespace kvwire::fuzz {
namespace {

void Run(const uint8_t* data, size_t size) {
  auto file = SafetensorsFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size),
                                         "fuzz.safetensors");
  if (!file.ok()) return;
  volatile uint8_t sink = 0;  // keeps the reads
  for (const auto& [name, view] : (*file)->tensors()) {
    KVWIRE_CHECK((*file)->Find(name) == &view);
    const size_t elem = SafetensorsDTypeSize(view.dtype);
    KVWIRE_CHECK(elem > 0);
    KVWIRE_CHECK(static_cast<uint64_t>(view.numel()) * elem == view.bytes);
    if (view.bytes > 0) sink = view.data[0] ^ view.data[view.bytes - 1];
  }
  (void)sink;
}

}  // namespace
}  // namespace kvwire::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvwire::fuzz::Run(data, size);
  return 0;
}
