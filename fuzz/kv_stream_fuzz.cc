// Fuzzes the decode node's receiving side of the compressed KV stream: raw bytes become
// kvwire.v1.PrefillResponse messages (kv_stream_input.h says how), which go through
// FromProto into a KvAssembler filling a KvCache, as GrpcKvSource feeds the decode engine.
// Shapes (layers, heads, head_dim, dtype, policy, budget, prompt length, chunk limit) come
// from the input's first bytes. Beyond the sanitizers, a stream the assembler accepts must
// have left every layer of the cache whole, with positions ascending inside the prompt.
#include <google/protobuf/stubs/logging.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

#include "common/base/status.h"
#include "common/compression/compression.h"
#include "common/model/kv_cache.h"
#include "common/wire/kv_wire.h"
#include "fuzz/kv_stream_input.h"
#include "kernels/coded_rows.h"
#include "kvwire/v1/prefill.pb.h"
#include "proto/convert.h"

namespace kvwire::fuzz {
namespace {

// KVWIRE_FUZZ_VERBOSE=1: what the assembler said to each message (to check seeds).
bool Verbose() {
  static const bool verbose = std::getenv("KVWIRE_FUZZ_VERBOSE") != nullptr;
  return verbose;
}

absl::Status Feed(v1::PrefillResponse& msg, const KvStreamParams& params, KvAssembler& assembler) {
  switch (msg.message_case()) {
    case v1::PrefillResponse::kHeader: {
      auto header = FromProto(msg.header());
      return header.ok() ? assembler.OnHeader(*header) : header.status();
    }
    case v1::PrefillResponse::kChunk: {
      WireChunk chunk = FromProto(msg.mutable_chunk());
      if (params.fix_checksums) chunk.crc32c = ChunkChecksum(chunk);
      return assembler.OnChunk(chunk);
    }
    case v1::PrefillResponse::kTrailer:
      return assembler.OnTrailer(FromProto(msg.trailer()), kVocab);
    default:
      return absl::InvalidArgumentError("an empty PrefillResponse");
  }
}

// What a complete stream promises the decode engine.
void CheckComplete(const KvAssembler& assembler, const WireExpectation& expect,
                   const KvCache& cache) {
  const WireHeader& h = assembler.header();
  KVWIRE_CHECK(h.num_layers == cache.num_layers());
  for (int l = 0; l < cache.num_layers(); ++l) {
    const LayerCache& lc = cache.layer(l);
    KVWIRE_CHECK(lc.len == h.kept_per_layer[l] && lc.len >= 1 && lc.len <= lc.capacity);
    if (!expect.kept_per_layer.empty()) KVWIRE_CHECK(lc.len == expect.kept_per_layer[l]);
    std::vector<float> row(lc.head_dim);
    for (int head = 0; head < lc.n_heads; ++head) {
      for (int t = 0; t < lc.len; ++t) {
        const int32_t pos = lc.position(head, t);
        KVWIRE_CHECK(pos >= 0 && pos < h.prompt_len);
        KVWIRE_CHECK(t == 0 || pos > lc.position(head, t - 1));
        if (lc.coded()) {  // every row the stream stored reads back from within the cache
          kernels::CodedKeyRow(lc.k, lc.layout, lc.coding, lc.dtype, lc.head_dim, lc.len, head, t,
                               row.data());
          kernels::CodedValueRow(lc.v, lc.coding, lc.dtype, lc.head_dim, lc.len, head, t,
                                 row.data());
        }
      }
    }
  }
}

int Run(const uint8_t* data, size_t size) {
  if (size < kParamBytes) return -1;
  const std::optional<KvStreamParams> params = ReadKvStreamParams(data);
  if (!params) return -1;
  data += kParamBytes;
  size -= kParamBytes;

  const WireExpectation expect = KvStreamExpectation(*params);
  // A coded format's stream goes into a coded cache, as on a CPU decode node.
  KvCacheShape shape = CompressedCacheShape(params->compression, params->model, params->kv_dtype,
                                            params->prompt_len, params->extra_tokens);
  shape.format = DecodeCacheFormat(params->compression.kv_format);
  auto cache = KvCache::Create(shape, HeapKvAllocator());
  KVWIRE_CHECK(cache.ok());
  KvAssembler assembler(expect, cache->get());

  v1::PrefillResponse msg;
  while (size >= 2) {
    const size_t len = std::min<size_t>(data[0] | size_t{data[1]} << 8, size - 2);
    data += 2;
    size -= 2;
    const bool parsed = msg.ParseFromArray(data, static_cast<int>(len));
    data += len;
    size -= len;
    // Messages after a failure are fed too: the assembler must keep refusing them.
    const absl::Status st = parsed ? Feed(msg, *params, assembler) : absl::OkStatus();
    if (Verbose()) {
      std::fprintf(stderr, "%s\n", parsed ? st.ToString().c_str() : "(not a PrefillResponse)");
    }
  }
  if (Verbose()) std::fprintf(stderr, "complete: %d\n", assembler.complete());
  if (assembler.complete()) CheckComplete(assembler, expect, **cache);
  return 0;
}

}  // namespace
}  // namespace kvwire::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs every string field that is not UTF-8; the parse failing is enough.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvwire::fuzz::Run(data, size);
}
