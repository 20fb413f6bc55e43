// Writes kv_stream_fuzz's seeds: complete, valid streams (the parameter bytes, then the
// length-prefixed PrefillResponse messages) made by the sender's own code, ChunkLayer and
// ToProto, for a spread of shapes. Usage: kv_stream_seeds OUT_DIR (fuzz/make_seeds.py runs it).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/base/status.h"
#include "common/compression/compression.h"
#include "common/wire/kv_wire.h"
#include "fuzz/kv_stream_input.h"
#include "kvwire/v1/prefill.pb.h"
#include "proto/convert.h"

namespace kvwire::fuzz {
namespace {

void Append(const v1::PrefillResponse& msg, std::string* out) {
  const std::string bytes = msg.SerializeAsString();
  KVWIRE_CHECK(bytes.size() <= 0xffff);
  out->push_back(static_cast<char>(bytes.size() & 0xff));
  out->push_back(static_cast<char>(bytes.size() >> 8));
  out->append(bytes);
}

// A stream the receiver accepts: kept positions drawn at random, K/V random bytes.
std::string ValidStream(const std::vector<uint8_t>& param_bytes, uint32_t seed) {
  const std::optional<KvStreamParams> s = ReadKvStreamParams(param_bytes.data());
  KVWIRE_CHECK(s.has_value());
  std::mt19937 rng(seed);
  std::string out(param_bytes.begin(), param_bytes.end());

  WireHeader h;
  h.model_fingerprint = kFingerprint;
  h.num_layers = s->model.num_layers;
  h.num_cache_heads = s->compression.CacheHeads(s->model.num_heads, s->model.num_kv_heads);
  h.head_dim = s->model.head_dim;
  h.dtype = s->kv_dtype;
  h.kv_format = s->compression.kv_format;
  h.policy = s->compression.Describe();
  h.prompt_len = s->prompt_len;
  for (int l = 0; l < h.num_layers; ++l) {
    h.kept_per_layer.push_back(s->compression.KeptTokens(l, h.prompt_len));
  }
  v1::PrefillResponse msg;
  *msg.mutable_header() = ToProto(h);
  Append(msg, &out);

  WireTrailer trailer;
  for (int l = 0; l < h.num_layers; ++l) {
    CompressedLayer layer;
    layer.layer = l;
    layer.n_heads = h.num_cache_heads;
    layer.head_dim = h.head_dim;
    layer.count = h.kept_per_layer[l];
    layer.dtype = h.dtype;
    for (int head = 0; head < h.num_cache_heads; ++head) {
      std::vector<int32_t> all(h.prompt_len);
      for (int i = 0; i < h.prompt_len; ++i) all[i] = i;
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(layer.count);
      std::sort(all.begin(), all.end());
      layer.positions.insert(layer.positions.end(), all.begin(), all.end());
    }
    layer.k.resize(static_cast<size_t>(layer.n_heads) * layer.count * layer.head_dim *
                   DTypeSize(layer.dtype));
    layer.v.resize(layer.k.size());
    for (uint8_t& b : layer.k) b = static_cast<uint8_t>(rng());
    for (uint8_t& b : layer.v) b = static_cast<uint8_t>(rng());
    for (WireChunk& chunk : ChunkLayer(layer, h.kv_format, s->max_chunk_bytes)) {
      trailer.kv_payload_bytes += static_cast<int64_t>(chunk.payload_bytes());
      ++trailer.chunks;
      ToProto(std::move(chunk), msg.mutable_chunk());
      Append(msg, &out);
    }
  }
  trailer.first_token = 1;
  trailer.node = "prefill-0";
  *msg.mutable_trailer() = ToProto(trailer);
  Append(msg, &out);
  return out;
}

// Parameter bytes (kv_stream_input.h): layers/skip, heads, head_dim/dtype, policy, prompt,
// budget, window/extra, flags. Small shapes: seeds of a few KiB at most.
const std::vector<std::vector<uint8_t>> kSeeds = {
    {0, 0, 0, 0, 9, 0, 0, 0x00},       // 1 layer, 1 head, full, prompt 10
    {1, 1, 1, 3, 39, 4, 3, 0x03},      // 2 layers, GQA, snapkv_pp budget 9, checked kept
    {2, 4, 5, 8, 47, 8, 0x13, 0x06},   // snapkv per query head, bf16, 1 extra token
    {5, 2, 8, 4, 63, 0x9f, 7, 0x02},   // chunkkv by ratio 0.25, skip 1 layer, f16
    {3, 0, 2, 5, 80, 20, 0x27, 0x0a},  // hbw, 4 layers, 256-byte chunks split heads
    {0, 2, 3, 1, 30, 12, 2, 0x00},     // streaming, head_dim 16: chunks of single tokens
    {1, 3, 0, 0, 3, 0, 0, 0x1c},       // full, short prompt, 8 KiB chunks
    {0, 1, 12, 2, 60, 10, 3, 0x02},    // snapkv in fp8, head_dim 2
    {1, 2, 25, 3, 70, 14, 5, 0x06},    // snapkv_pp in int8, head_dim 4
    {0, 0, 42, 0, 40, 0, 0, 0x0e},     // full in int4, bf16 cache, 512-byte chunks
    {2, 1, 51, 4, 90, 0x8f, 2, 0x00},  // chunkkv in bf16 from an f32 cache, head_dim 16
};

}  // namespace
}  // namespace kvwire::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  int n = 0;
  for (const auto& params : kvwire::fuzz::kSeeds) {
    const std::string path = absl::StrFormat("%s/valid-%02d", argv[1], n);
    std::ofstream(path, std::ios::binary) << kvwire::fuzz::ValidStream(params, 1000 + n);
    ++n;
  }
  std::printf("wrote %d seeds to %s\n", n, argv[1]);
  return 0;
}
