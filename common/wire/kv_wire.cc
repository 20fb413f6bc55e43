#include "common/wire/kv_wire.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace kvwire {
namespace {

// Reflected Castagnoli polynomial.
constexpr uint32_t kPoly = 0x82f63b78u;

[[maybe_unused]] std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

void AppendU32(std::string* s, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);  // little-endian hosts only (x86-64, aarch64)
  s->append(b, 4);
}

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed KV stream: ", what));
}

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__SSE4_2__)
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
  }
  crc = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) crc = _mm_crc32_u8(crc, *p);
#else
  static const std::array<uint32_t, 256> table = MakeTable();
  for (; n > 0; --n, ++p) crc = table[(crc ^ *p) & 0xff] ^ (crc >> 8);
#endif
  return ~crc;
}

uint32_t ChunkChecksum(const WireChunk& c) {
  std::string head;
  for (int v : {c.layer, c.head_begin, c.head_count, c.token_begin, c.token_count}) {
    AppendU32(&head, static_cast<uint32_t>(v));
  }
  uint32_t crc = Crc32c(head.data(), head.size());
  crc = Crc32c(c.positions.data(), c.positions.size(), crc);
  crc = Crc32c(c.k.data(), c.k.size(), crc);
  return Crc32c(c.v.data(), c.v.size(), crc);
}

std::vector<WireChunk> ChunkLayer(const CompressedLayer& layer, size_t max_bytes) {
  const size_t row = static_cast<size_t>(layer.head_dim) * DTypeSize(layer.dtype);
  const size_t per_token = sizeof(int32_t) + 2 * row;
  const size_t per_head = per_token * layer.count;
  std::vector<WireChunk> out;
  auto emit = [&](int h0, int hn, int t0, int tn) {
    WireChunk c;
    c.layer = layer.layer;
    c.head_begin = h0;
    c.head_count = hn;
    c.token_begin = t0;
    c.token_count = tn;
    for (int h = h0; h < h0 + hn; ++h) {
      const size_t base = static_cast<size_t>(h) * layer.count + t0;
      c.positions.append(reinterpret_cast<const char*>(&layer.positions[base]),
                         sizeof(int32_t) * tn);
      c.k.append(reinterpret_cast<const char*>(&layer.k[base * row]), row * tn);
      c.v.append(reinterpret_cast<const char*>(&layer.v[base * row]), row * tn);
    }
    c.crc32c = ChunkChecksum(c);
    out.push_back(std::move(c));
  };
  int h = 0;
  while (h < layer.n_heads) {
    if (per_head <= max_bytes || layer.count == 0) {
      const int fit = per_head == 0 ? layer.n_heads : static_cast<int>(max_bytes / per_head);
      const int hn = std::min(layer.n_heads - h, std::max(1, fit));
      emit(h, hn, 0, layer.count);
      h += hn;
    } else {
      const int tokens = std::max<int>(1, static_cast<int>(max_bytes / per_token));
      for (int t = 0; t < layer.count; t += tokens)
        emit(h, 1, t, std::min(tokens, layer.count - t));
      ++h;
    }
  }
  return out;
}

KvAssembler::KvAssembler(WireExpectation expect, KvCache* cache)
    : expect_(std::move(expect)), cache_(cache) {}

absl::Status KvAssembler::Fail(absl::Status status) {
  failed_ = true;
  return status;
}

absl::Status KvAssembler::OnHeader(const WireHeader& h) {
  if (failed_) return absl::FailedPreconditionError("KV stream already failed");
  if (header_seen_) return Fail(Malformed("a second header"));
  if (h.format_version != kWireFormatVersion) {
    return Fail(Malformed(absl::StrCat("format version ", h.format_version,
                                       "; this node speaks version ", kWireFormatVersion)));
  }
  if (h.model_fingerprint != expect_.model_fingerprint) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "KV stream is for model '", h.model_fingerprint, "' but this node serves '",
        expect_.model_fingerprint, "' (prefill and decode nodes must run the same model)")));
  }
  if (h.num_layers != expect_.num_layers || h.num_cache_heads != expect_.num_cache_heads ||
      h.head_dim != expect_.head_dim || h.dtype != expect_.dtype) {
    return Fail(Malformed(absl::StrCat(
        "header says ", h.num_layers, " layers x ", h.num_cache_heads, " heads x ", h.head_dim, " ",
        DTypeName(h.dtype), "; expected ", expect_.num_layers, " x ", expect_.num_cache_heads,
        " x ", expect_.head_dim, " ", DTypeName(expect_.dtype))));
  }
  if (h.prompt_len != expect_.prompt_len) {
    return Fail(Malformed(absl::StrCat("header says the prompt has ", h.prompt_len,
                                       " tokens; the request had ", expect_.prompt_len)));
  }
  if (static_cast<int>(h.kept_per_layer.size()) != h.num_layers) {
    return Fail(Malformed(absl::StrCat("kept_per_layer has ", h.kept_per_layer.size(),
                                       " entries for ", h.num_layers, " layers")));
  }
  for (int l = 0; l < h.num_layers; ++l) {
    const int kept = h.kept_per_layer[l];
    if (kept < 1 || kept > h.prompt_len || kept > cache_->layer(l).capacity) {
      return Fail(Malformed(absl::StrCat("layer ", l, " keeps ", kept, " tokens; expected 1..",
                                         std::min(h.prompt_len, cache_->layer(l).capacity))));
    }
    if (!expect_.kept_per_layer.empty() && kept != expect_.kept_per_layer[l]) {
      return Fail(Malformed(absl::StrCat("layer ", l, " keeps ", kept,
                                         " tokens but the request's compression keeps ",
                                         expect_.kept_per_layer[l])));
    }
    cache_->layer(l).len = 0;
  }
  header_ = h;
  header_seen_ = true;
  return absl::OkStatus();
}

absl::Status KvAssembler::CheckChunk(const WireChunk& c) {
  if (!header_seen_) return Malformed("a chunk before the header");
  if (layer_ >= header_.num_layers) return Malformed("a chunk after the last layer");
  const int kept = header_.kept_per_layer[layer_];
  const std::string where =
      absl::StrCat("chunk of layer ", c.layer, " heads ", c.head_begin, "+", c.head_count,
                   " tokens ", c.token_begin, "+", c.token_count);
  if (c.layer != layer_ || c.head_begin != head_ || c.token_begin != token_) {
    return Malformed(absl::StrCat(where, ": out of order; expected layer ", layer_, " head ", head_,
                                  " token ", token_));
  }
  // int64: the counts come from the network and may be anything up to INT_MAX.
  if (c.head_count < 1 || c.token_count < 1 ||
      int64_t{c.head_begin} + c.head_count > header_.num_cache_heads ||
      int64_t{c.token_begin} + c.token_count > kept) {
    return Malformed(absl::StrCat(where, ": outside the layer's ", header_.num_cache_heads,
                                  " heads x ", kept, " tokens"));
  }
  if (c.head_count > 1 && (c.token_begin != 0 || c.token_count != kept)) {
    return Malformed(
        absl::StrCat(where, ": a chunk of several heads must hold all ", kept, " of their tokens"));
  }
  const size_t cells = static_cast<size_t>(c.head_count) * c.token_count;
  const size_t kv_bytes = cells * header_.head_dim * DTypeSize(header_.dtype);
  if (c.positions.size() != cells * sizeof(int32_t) || c.k.size() != kv_bytes ||
      c.v.size() != kv_bytes) {
    return Malformed(absl::StrCat(where, ": payload of ", c.positions.size(), "/", c.k.size(), "/",
                                  c.v.size(), " bytes (positions/K/V); expected ",
                                  cells * sizeof(int32_t), "/", kv_bytes, "/", kv_bytes));
  }
  if (c.payload_bytes() > std::min(expect_.max_chunk_bytes, kMaxChunkBytesLimit) &&
      c.token_count > 1) {
    return Malformed(absl::StrCat(where, ": ", c.payload_bytes(), " bytes exceeds the ",
                                  expect_.max_chunk_bytes, "-byte chunk limit"));
  }
  if (ChunkChecksum(c) != c.crc32c) {
    return absl::DataLossError(absl::StrCat(where, ": CRC-32C mismatch (corrupted in transit)"));
  }
  LayerCache& lc = cache_->layer(c.layer);
  for (int h = 0; h < c.head_count; ++h) {
    const int head = c.head_begin + h;
    int32_t prev = c.token_begin == 0 ? -1 : lc.position(head, c.token_begin - 1);
    for (int t = 0; t < c.token_count; ++t) {
      int32_t pos;
      std::memcpy(&pos, c.positions.data() + (static_cast<size_t>(h) * c.token_count + t) * 4, 4);
      if (pos <= prev || pos >= header_.prompt_len) {
        return Malformed(absl::StrCat(where, ": position ", pos, " of head ", head,
                                      " is not ascending within [0, ", header_.prompt_len, ")"));
      }
      prev = pos;
    }
  }
  return absl::OkStatus();
}

absl::Status KvAssembler::OnChunk(const WireChunk& c) {
  if (failed_) return absl::FailedPreconditionError("KV stream already failed");
  if (absl::Status st = CheckChunk(c); !st.ok()) return Fail(st);
  LayerCache& lc = cache_->layer(c.layer);
  const size_t row = lc.row_bytes();
  for (int h = 0; h < c.head_count; ++h) {
    const int head = c.head_begin + h;
    const size_t src = static_cast<size_t>(h) * c.token_count;
    // Into the cache's rows where they are: host memory, or a device's pages (staged copies).
    if (absl::Status st =
            cache_->WriteRows(c.layer, head, c.token_begin, c.token_count,
                              reinterpret_cast<const uint8_t*>(c.k.data()) + src * row,
                              reinterpret_cast<const uint8_t*>(c.v.data()) + src * row);
        !st.ok()) {
      return Fail(st);
    }
    std::memcpy(lc.positions + int64_t{head} * lc.capacity + c.token_begin,
                c.positions.data() + src * sizeof(int32_t), sizeof(int32_t) * c.token_count);
  }
  payload_bytes_ += static_cast<int64_t>(c.payload_bytes());
  ++chunks_;
  const int kept = header_.kept_per_layer[layer_];
  if (c.token_begin + c.token_count == kept) {
    head_ += c.head_count;
    token_ = 0;
  } else {
    token_ += c.token_count;
  }
  if (head_ == header_.num_cache_heads) {
    lc.len = kept;
    ++layer_;
    head_ = 0;
  }
  return absl::OkStatus();
}

absl::Status KvAssembler::OnTrailer(const WireTrailer& t, int vocab_size) {
  if (failed_) return absl::FailedPreconditionError("KV stream already failed");
  if (!header_seen_) return Fail(Malformed("a trailer before the header"));
  if (complete_) return Fail(Malformed("a second trailer"));
  if (layer_ != header_.num_layers) {
    return Fail(Malformed(absl::StrCat("trailer after ", layer_, " of ", header_.num_layers,
                                       " layers (layer ", layer_, " incomplete at head ", head_,
                                       " token ", token_, ")")));
  }
  if (t.first_token < 0 || t.first_token >= vocab_size) {
    return Fail(Malformed(
        absl::StrCat("first token ", t.first_token, " is outside the vocabulary of ", vocab_size)));
  }
  if (t.kv_payload_bytes != payload_bytes_ || t.chunks != chunks_) {
    return Fail(
        Malformed(absl::StrCat("trailer counts ", t.chunks, " chunks / ", t.kv_payload_bytes,
                               " bytes but ", chunks_, " / ", payload_bytes_, " arrived")));
  }
  complete_ = true;
  return absl::OkStatus();
}

}  // namespace kvwire
