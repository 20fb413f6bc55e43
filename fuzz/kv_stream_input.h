// How kv_stream_fuzz reads its input, shared with the seed generator (kv_stream_seeds.cc):
// the first kParamBytes bytes choose a small model, a compression and the receiver's
// settings, so that shapes vary with the input; the rest is the stream, a sequence of
// kvwire.v1.PrefillResponse messages each preceded by its length (uint16 little-endian).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "common/compression/compression.h"
#include "common/compression/policy.h"
#include "common/model/model_config.h"
#include "common/wire/kv_wire.h"

namespace kvwire::fuzz {

inline constexpr size_t kParamBytes = 8;
inline constexpr char kFingerprint[] = "fuzz-model";
inline constexpr int kVocab = 512;

struct KvStreamParams {
  ModelConfig model;
  CompressionConfig compression;
  DType kv_dtype = DType::kF32;
  int prompt_len = 0;
  int extra_tokens = 0;  // room for generated tokens in the cache
  // The receiver checks kept_per_layer against its own compression (the decode node does);
  // else the header's counts are only bounded by the cache.
  bool check_kept = false;
  // The fuzzer recomputes each chunk's CRC-32C, as a faulty or hostile sender would, so that
  // mutated payloads get past the checksum to the checks behind it.
  bool fix_checksums = false;
  size_t max_chunk_bytes = kDefaultMaxChunkBytes;
  // Where the sender is said to write the rows (shm, cuda_ipc): the chunks are then placed, and
  // the receiver checks what the cache holds (its positions, on cuda_ipc, from the chunks).
  KvPlacement placement = KvPlacement::kNone;
};

// Decodes the parameter bytes; nullopt for a combination the compression rejects.
inline std::optional<KvStreamParams> ReadKvStreamParams(const uint8_t p[kParamBytes]) {
  KvStreamParams s;
  ModelConfig& m = s.model;
  m.architecture = "LlamaForCausalLM";
  m.model_type = "llama";
  m.num_layers = 1 + p[0] % 4;
  m.num_kv_heads = 1 + p[1] % 3;
  m.num_heads = m.num_kv_heads * (1 + (p[1] / 3) % 2);
  m.head_dim = 2 << (p[2] % 4);
  m.hidden_size = m.num_heads * m.head_dim;
  m.intermediate_size = 4;
  m.vocab_size = kVocab;
  m.max_position_embeddings = 4096;
  s.kv_dtype = static_cast<DType>((p[2] / 4) % 3);

  static const char* const kPolicies[] = {"full",      "streaming", "snapkv",
                                          "snapkv_pp", "chunkkv",   "hbw"};
  const char* name = kPolicies[p[3] % 6];
  ParamValues params;
  // The original SnapKV under GQA: one cache head per query head.
  if (std::string(name) == "snapkv" && (p[3] / 6) % 2 == 1) params["gqa"] = "per_query_head";
  auto policy = MakePolicy(name, params);
  if (!policy.ok()) return std::nullopt;
  CompressionConfig& c = s.compression;
  c.policy = *policy;
  c.kv_format = kAllKvFormats[(p[2] / 12) % 5];
  c.window = 1 + p[6] % 16;
  c.skip_layers = (p[0] / 4) % 3;
  if (p[5] & 0x80) {
    c.ratio = ((p[5] & 0x7f) + 1) / 128.0;
  } else {
    c.budget = c.window + 1 + p[5] % 64;
  }
  if (!c.Validate().ok()) return std::nullopt;

  s.prompt_len = 1 + p[4] % 128;
  s.extra_tokens = (p[6] / 16) % 4;
  s.fix_checksums = p[7] & 1;
  s.check_kept = p[7] & 2;
  s.max_chunk_bytes = size_t{64} << ((p[7] >> 2) % 8);
  s.placement = static_cast<KvPlacement>((p[7] >> 5) % 3);
  return s;
}

// What the decode node would expect of the stream (as StreamExpectation does for a model).
inline WireExpectation KvStreamExpectation(const KvStreamParams& s) {
  WireExpectation e;
  e.model_fingerprint = kFingerprint;
  e.num_layers = s.model.num_layers;
  e.num_cache_heads = s.compression.CacheHeads(s.model.num_heads, s.model.num_kv_heads);
  e.head_dim = s.model.head_dim;
  e.dtype = s.kv_dtype;
  e.kv_format = s.compression.kv_format;
  e.prompt_len = s.prompt_len;
  if (s.check_kept) {
    for (int l = 0; l < s.model.num_layers; ++l) {
      e.kept_per_layer.push_back(s.compression.KeptTokens(l, s.prompt_len));
    }
  }
  e.max_chunk_bytes = s.max_chunk_bytes;
  e.placement = s.placement;
  return e;
}

}  // namespace kvwire::fuzz
