#include "common/wire/kv_wire.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

void AppendU32(std::string* s, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);  // little-endian hosts only (x86-64, aarch64)
  s->append(b, 4);
}

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed KV stream: ", what));
}

// Unsigned LEB128, as protobuf codes its varints; a 32-bit value takes at most 5 bytes.
constexpr size_t kMaxVarintBytes = 5;
void AppendVarint(std::string* s, uint32_t v) {
  while (v >= 0x80) {
    s->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s->push_back(static_cast<char>(v));
}
bool ReadVarint(absl::string_view in, size_t* offset, uint32_t* v) {
  uint64_t x = 0;
  for (size_t i = 0; i < kMaxVarintBytes; ++i) {
    if (*offset >= in.size()) return false;
    const uint8_t b = static_cast<uint8_t>(in[(*offset)++]);
    x |= uint64_t{b & 0x7fu} << (7 * i);
    if ((b & 0x80) == 0) {
      if (x > UINT32_MAX) return false;
      *v = static_cast<uint32_t>(x);
      return true;
    }
  }
  return false;
}

// The CRC-32C of a chunk's five rectangle fields (int32 LE), where both checksums begin.
uint32_t RectangleChecksum(const WireChunk& c) {
  std::string head;
  for (int v : {c.layer, c.head_begin, c.head_count, c.token_begin, c.token_count}) {
    AppendU32(&head, static_cast<uint32_t>(v));
  }
  return Crc32c(head.data(), head.size());
}

// How messages name a chunk.
std::string ChunkName(const WireChunk& c) {
  return absl::StrCat("chunk of layer ", c.layer, " heads ", c.head_begin, "+", c.head_count,
                      " tokens ", c.token_begin, "+", c.token_count);
}

}  // namespace

uint32_t ChunkChecksum(const WireChunk& c) {
  uint32_t crc = RectangleChecksum(c);
  crc = Crc32c(c.positions.data(), c.positions.size(), crc);
  crc = Crc32c(c.k.data(), c.k.size(), crc);
  return Crc32c(c.v.data(), c.v.size(), crc);
}

WireExpectation ExpectHeader(const WireHeader& h) {
  WireExpectation e;
  e.model_fingerprint = h.model_fingerprint;
  e.num_layers = h.num_layers;
  e.num_cache_heads = h.num_cache_heads;
  e.head_dim = h.head_dim;
  e.dtype = h.dtype;
  e.kv_format = h.kv_format;
  e.prompt_len = h.prompt_len;
  e.kept_per_layer = h.kept_per_layer;
  return e;
}

absl::string_view KvTransportName(KvTransport t) {
  switch (t) {
    case KvTransport::kGrpc:
      return "grpc";
    case KvTransport::kShm:
      return "shm";
    case KvTransport::kCudaIpc:
      return "cuda_ipc";
    case KvTransport::kNccl:
      return "nccl";
  }
  return "?";
}

KvPlacement PlacementOf(KvTransport t) {
  switch (t) {
    case KvTransport::kGrpc:
      return KvPlacement::kNone;
    case KvTransport::kShm:
      return KvPlacement::kRowsAndPositions;
    case KvTransport::kCudaIpc:
    case KvTransport::kNccl:
      return KvPlacement::kRows;
  }
  return KvPlacement::kNone;
}

absl::StatusOr<KvTransport> ParseKvTransport(absl::string_view name) {
  if (name == "grpc") return KvTransport::kGrpc;
  if (name == "shm") return KvTransport::kShm;
  if (name == "cuda_ipc") return KvTransport::kCudaIpc;
  if (name == "nccl") return KvTransport::kNccl;
  return absl::InvalidArgumentError(
      absl::StrCat("must be grpc, shm, cuda_ipc or nccl; got '", name, "'"));
}

bool IsLinkPeerName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
  }
  return true;
}

absl::StatusOr<WireChunk> PlacedChunk(const WireChunk& c, const KvCache& cache, int kept,
                                      bool with_positions) {
  WireChunk p;
  p.layer = c.layer;
  p.head_begin = c.head_begin;
  p.head_count = c.head_count;
  p.token_begin = c.token_begin;
  p.token_count = c.token_count;
  p.placed = true;
  p.placed_bytes = static_cast<int64_t>(c.payload_bytes());
  if (with_positions) p.positions = c.positions;
  ASSIGN_OR_RETURN(p.crc32c, PlacedChecksum(cache, p, kept));
  return p;
}

PlacedSpans PlacedSpansOf(const KvCache& cache, const WireChunk& c, int kept) {
  const LayerCache& lc = cache.layer(c.layer);
  const kernels::KvCoding& coding = lc.coding;
  const int d = lc.head_dim;
  PlacedSpans out;
  auto add = [&](const uint8_t* data, int64_t bytes) {
    out.spans.push_back({data, bytes});
    out.bytes += bytes;
  };
  for (int h = c.head_begin; h < c.head_begin + c.head_count; ++h) {
    for (int t = c.token_begin; t < c.token_begin + c.token_count; ++t) {
      if (lc.coded()) {
        const int kc = CodedKeyRowBytes(coding.format, d),
                  vc = CodedValueRowBytes(coding.format, d);
        add(lc.k + lc.layout.Row(h, t, kc), kc);
        add(lc.v + coding.v_layout.Row(h, t, vc), vc);
      } else {
        const int64_t at = lc.layout.Row(h, t, d) * static_cast<int64_t>(DTypeSize(lc.dtype));
        const auto row = static_cast<int64_t>(lc.row_bytes());
        add(lc.k + at, row);
        add(lc.v + at, row);
      }
    }
    if (lc.coded()) {
      const KvGroups groups{kept};
      const int g0 = groups.Of(c.token_begin), g1 = groups.Of(c.token_begin + c.token_count - 1);
      const auto group_bytes = static_cast<int64_t>(KvKeyGroupBytes(coding.format, d));
      add(coding.k_params + (int64_t{h} * coding.max_groups + g0) * group_bytes,
          (g1 - g0 + 1) * group_bytes);
      if (coding.format == KvFormat::kFP8) {
        add(coding.v_scales + int64_t{h} * coding.max_groups + g0, g1 - g0 + 1);
      }
    }
    out.head_end.push_back(out.spans.size());
  }
  return out;
}

absl::StatusOr<uint32_t> PlacedChecksum(const KvCache& cache, const WireChunk& c, int kept) {
  const LayerCache& lc = cache.layer(c.layer);
  // Every head's spans in order: its rows, then (coded) its groups' parameters and scales.
  const PlacedSpans placed = PlacedSpansOf(cache, c, kept);
  const std::vector<kernels::ByteSpan>& spans = placed.spans;
  const std::vector<size_t>& head_end = placed.head_end;
  std::vector<uint32_t> sums(spans.size());
  if (cache.host_rows()) {
    for (size_t i = 0; i < spans.size(); ++i) {
      sums[i] = Crc32c(spans[i].data, static_cast<size_t>(spans[i].bytes));
    }
  } else if (!spans.empty()) {
    RETURN_IF_ERROR(cache.backend()->ChecksumSpans(
        {spans.data(), static_cast<int>(spans.size()), sums.data()}));
  }
  uint32_t crc = RectangleChecksum(c);
  size_t from = 0;
  for (int h = c.head_begin; h < c.head_begin + c.head_count; ++h) {
    crc = Crc32c(lc.positions + int64_t{h} * lc.capacity + c.token_begin,
                 sizeof(int32_t) * c.token_count, crc);
    const size_t to = head_end[h - c.head_begin];
    crc = Crc32c(sums.data() + from, sizeof(uint32_t) * (to - from), crc);  // LE hosts only
    from = to;
  }
  return crc;
}

void EncodePositions(const int32_t* positions, int n, std::string* out) {
  if (n == 0) {
    out->push_back(0);
    return;
  }
  std::string deltas(1, '\0');
  for (int i = 0; i < n; ++i) {
    AppendVarint(&deltas, static_cast<uint32_t>(i == 0 ? positions[0]
                                                       : positions[i] - positions[i - 1] - 1));
  }
  const uint32_t first = static_cast<uint32_t>(positions[0]);
  const uint32_t span = static_cast<uint32_t>(positions[n - 1] - positions[0]) + 1;
  std::string bitmap(1, '\1');
  AppendVarint(&bitmap, first);
  AppendVarint(&bitmap, span);
  if (bitmap.size() + (span + 7) / 8 < deltas.size()) {
    const size_t at = bitmap.size();
    bitmap.resize(at + (span + 7) / 8, '\0');
    for (int i = 0; i < n; ++i) {
      const uint32_t b = static_cast<uint32_t>(positions[i]) - first;
      bitmap[at + b / 8] = static_cast<char>(bitmap[at + b / 8] | (1u << (b % 8)));
    }
    out->append(bitmap);
  } else {
    out->append(deltas);
  }
}

absl::Status DecodePositions(absl::string_view in, size_t* offset, int n, int prompt_len,
                             int32_t* positions) {
  if (*offset >= in.size()) return Malformed("positions end before every head's");
  const uint8_t tag = static_cast<uint8_t>(in[(*offset)++]);
  const auto bad = [&](absl::string_view what) {
    return Malformed(absl::StrCat("positions: ", what));
  };
  if (tag == 0) {
    int64_t prev = -1;
    for (int i = 0; i < n; ++i) {
      uint32_t gap = 0;
      if (!ReadVarint(in, offset, &gap)) return bad("a delta is cut off or longer than 5 bytes");
      const int64_t pos = prev + 1 + gap;
      if (pos >= prompt_len) {
        return bad(absl::StrCat("position ", pos, " is outside the prompt of ", prompt_len));
      }
      positions[i] = static_cast<int32_t>(pos);
      prev = pos;
    }
    return absl::OkStatus();
  }
  if (tag != 1) return bad(absl::StrCat("unknown coding ", int{tag}, "; expected 0 or 1"));
  uint32_t first = 0, span = 0;
  if (!ReadVarint(in, offset, &first) || !ReadVarint(in, offset, &span)) {
    return bad("a bitmap's first position or span is cut off");
  }
  if (span < 1 || int64_t{first} + span > prompt_len) {
    return bad(absl::StrCat("a bitmap of ", span, " positions from ", first,
                            " is outside the prompt of ", prompt_len));
  }
  const size_t bytes = (span + 7) / 8;
  if (in.size() - *offset < bytes) return bad("a bitmap is cut off");
  int got = 0;
  for (uint32_t b = 0; b < span; ++b) {
    if ((static_cast<uint8_t>(in[*offset + b / 8]) >> (b % 8)) & 1u) {
      if (got == n) return bad(absl::StrCat("a bitmap holds more than ", n, " positions"));
      positions[got++] = static_cast<int32_t>(first + b);
    }
  }
  *offset += bytes;
  if (got != n || positions[0] != static_cast<int32_t>(first) ||
      positions[n - 1] != static_cast<int32_t>(first + span - 1)) {
    return bad(absl::StrCat("a bitmap holds ", got, " positions from ", first, " over ", span,
                            "; expected ", n, " from its first to its last bit"));
  }
  return absl::OkStatus();
}

std::vector<WireChunk> ChunkLayer(const CompressedLayer& layer, KvFormat format, size_t max_bytes) {
  const int d = layer.head_dim;
  const size_t row = static_cast<size_t>(d) * DTypeSize(layer.dtype);
  // A head's payload for n tokens, bounded from above: a position codes in at most 5 bytes, a
  // head's positions header in 11, and n tokens touch at most n / G + 3 groups (part of one,
  // whole ones, part of the last below the recent tokens, the recent group).
  const auto head_bytes = [&](int n) {
    const int groups = KvCoded(format) ? n / kKeyGroupTokens + 3 : 0;
    return 2 * kMaxVarintBytes + 1 + n * kMaxVarintBytes +
           n * (KvKeyCodeBytes(format, layer.dtype, d) + KvValueRowBytes(format, layer.dtype, d)) +
           groups * (KvKeyGroupBytes(format, d) + 1);
  };
  std::vector<WireChunk> out;
  auto emit = [&](int h0, int hn, int t0, int tn) {
    WireChunk c;
    c.layer = layer.layer;
    c.head_begin = h0;
    c.head_count = hn;
    c.token_begin = t0;
    c.token_count = tn;
    const size_t k_block = KvKeyBlockBytes(format, layer.dtype, d, layer.count, t0, tn);
    const size_t v_block = KvValueBlockBytes(format, layer.dtype, d, layer.count, t0, tn);
    c.k.resize(k_block * hn);
    c.v.resize(v_block * hn);
    for (int h = h0; h < h0 + hn; ++h) {
      const size_t base = static_cast<size_t>(h) * layer.count;
      EncodePositions(&layer.positions[base + t0], tn, &c.positions);
      EncodeKvKeys(format, layer.dtype, d, layer.count, t0, tn, &layer.k[base * row],
                   &c.k[(h - h0) * k_block]);
      EncodeKvValues(format, layer.dtype, d, layer.count, t0, tn, &layer.v[base * row],
                     &c.v[(h - h0) * v_block]);
    }
    c.crc32c = ChunkChecksum(c);
    out.push_back(std::move(c));
  };
  const size_t per_head = head_bytes(layer.count);
  int h = 0;
  while (h < layer.n_heads) {
    if (per_head <= max_bytes || layer.count == 0) {
      const int fit = static_cast<int>(max_bytes / per_head);
      const int hn = std::min(layer.n_heads - h, std::max(1, fit));
      emit(h, hn, 0, layer.count);
      h += hn;
    } else {
      // The most tokens of one head that fit (at least one).
      int lo = 1, hi = layer.count;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (head_bytes(mid) <= max_bytes) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      for (int t = 0; t < layer.count; t += lo) emit(h, 1, t, std::min(lo, layer.count - t));
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
  if (h.kv_format != expect_.kv_format) {
    return Fail(
        Malformed(absl::StrCat("header says K/V are coded in ", KvFormatName(h.kv_format),
                               "; the request asked for ", KvFormatName(expect_.kv_format))));
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
    LayerCache& lc = cache_->layer(l);
    if (lc.coded() && lc.coding.format != h.kv_format) {
      return Fail(absl::FailedPreconditionError(
          absl::StrCat("the cache keeps rows coded in ", KvFormatName(lc.coding.format),
                       " but the stream codes them in ", KvFormatName(h.kv_format))));
    }
    lc.len = 0;
    lc.coding.kept = kept;
  }
  header_ = h;
  header_seen_ = true;
  return absl::OkStatus();
}

absl::Status KvAssembler::CheckChunk(const WireChunk& c) {
  if (!header_seen_) return Malformed("a chunk before the header");
  if (layer_ >= header_.num_layers) return Malformed("a chunk after the last layer");
  const int kept = header_.kept_per_layer[layer_];
  const std::string where = ChunkName(c);
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
  const bool placed = expect_.placement != KvPlacement::kNone;
  if (c.placed != placed) {
    return Malformed(absl::StrCat(where, placed ? ": its rows travel in it, but this stream "
                                                  "places them in the cache (shm, cuda_ipc, nccl)"
                                                : ": placed in the cache, but its rows travel on "
                                                  "this stream"));
  }
  if (c.placed) return CheckPlaced(c, where);
  const size_t cells = static_cast<size_t>(c.head_count) * c.token_count;
  const KvFormat f = header_.kv_format;
  const size_t k_bytes = c.head_count * KvKeyBlockBytes(f, header_.dtype, header_.head_dim, kept,
                                                        c.token_begin, c.token_count);
  const size_t v_bytes = c.head_count * KvValueBlockBytes(f, header_.dtype, header_.head_dim, kept,
                                                          c.token_begin, c.token_count);
  if (c.k.size() != k_bytes || c.v.size() != v_bytes) {
    return Malformed(absl::StrCat(where, ": K/V of ", c.k.size(), "/", c.v.size(),
                                  " bytes; expected ", k_bytes, "/", v_bytes, " (", cells,
                                  " rows in ", KvFormatName(f), ")"));
  }
  if (c.payload_bytes() > std::min(expect_.max_chunk_bytes, kMaxChunkBytesLimit) &&
      c.token_count > 1) {
    return Malformed(absl::StrCat(where, ": ", c.payload_bytes(), " bytes exceeds the ",
                                  expect_.max_chunk_bytes, "-byte chunk limit"));
  }
  if (ChunkChecksum(c) != c.crc32c) {
    return absl::DataLossError(absl::StrCat(where, ": CRC-32C mismatch (corrupted in transit)"));
  }
  return DecodeChunkPositions(c, where);
}

// The chunk's positions, per head, into positions_: each head's ascending within the prompt and
// after the previous chunk's last.
absl::Status KvAssembler::DecodeChunkPositions(const WireChunk& c, const std::string& where) {
  const LayerCache& lc = cache_->layer(c.layer);
  positions_.resize(static_cast<size_t>(c.head_count) * c.token_count);
  size_t offset = 0;
  for (int h = 0; h < c.head_count; ++h) {
    const int head = c.head_begin + h;
    int32_t* pos = positions_.data() + static_cast<size_t>(h) * c.token_count;
    if (absl::Status st =
            DecodePositions(c.positions, &offset, c.token_count, header_.prompt_len, pos);
        !st.ok()) {
      return Malformed(absl::StrCat(where, ", head ", head, ": ", st.message()));
    }
    const int32_t prev = c.token_begin == 0 ? -1 : lc.position(head, c.token_begin - 1);
    if (pos[0] <= prev) {
      return Malformed(absl::StrCat(where, ": position ", pos[0], " of head ", head,
                                    " does not follow the previous chunk's ", prev));
    }
  }
  if (offset != c.positions.size()) {
    return Malformed(absl::StrCat(where, ": ", c.positions.size() - offset,
                                  " bytes of positions left after every head's"));
  }
  return absl::OkStatus();
}

// A placed chunk's rows are in the cache already (shm, cuda_ipc): what the cache holds is
// checked as a chunk's payload would be (the checksum, then every position) before it is used.
// On cuda_ipc the positions travel in the chunk: decoded here, stored and checksummed by
// OnChunk (CheckPlacedRows).
absl::Status KvAssembler::CheckPlaced(const WireChunk& c, const std::string& where) {
  const bool positions_in_cache = expect_.placement == KvPlacement::kRowsAndPositions;
  if (!c.k.empty() || !c.v.empty() || positions_in_cache != c.positions.empty()) {
    return Malformed(absl::StrCat(
        where, positions_in_cache ? ": placed in the cache, yet it carries a payload"
                                  : ": placed in the cache, it must carry its positions only"));
  }
  const int kept = header_.kept_per_layer[layer_];
  const KvFormat f = header_.kv_format;
  const int64_t rows =
      int64_t{c.head_count} *
      (KvKeyBlockBytes(f, header_.dtype, header_.head_dim, kept, c.token_begin, c.token_count) +
       KvValueBlockBytes(f, header_.dtype, header_.head_dim, kept, c.token_begin, c.token_count));
  // Positions code in at most 5 bytes each and 11 per head besides (EncodePositions).
  const int64_t most = rows + int64_t{c.head_count} * (5 * int64_t{c.token_count} + 11);
  if (c.placed_bytes <= rows || c.placed_bytes > most ||
      (!positions_in_cache && c.placed_bytes != rows + static_cast<int64_t>(c.positions.size()))) {
    return Malformed(absl::StrCat(
        where, ": stands for ", c.placed_bytes, " bytes of payload; its rows alone are ", rows,
        positions_in_cache ? "" : absl::StrCat(" and its positions ", c.positions.size())));
  }
  if (!positions_in_cache) return DecodeChunkPositions(c, where);
  ASSIGN_OR_RETURN(const uint32_t crc, PlacedChecksum(*cache_, c, kept));
  if (crc != c.crc32c) {
    return absl::DataLossError(
        absl::StrCat(where, ": CRC-32C mismatch over the rows placed in the cache"));
  }
  const LayerCache& lc = cache_->layer(c.layer);
  for (int head = c.head_begin; head < c.head_begin + c.head_count; ++head) {
    int32_t prev = c.token_begin == 0 ? -1 : lc.position(head, c.token_begin - 1);
    for (int t = c.token_begin; t < c.token_begin + c.token_count; ++t) {
      const int32_t p = lc.position(head, t);
      if (p <= prev || p >= header_.prompt_len) {
        return Malformed(absl::StrCat(where, ": head ", head, " token ", t, " is at position ", p,
                                      " after ", prev, "; positions must ascend within [0, ",
                                      header_.prompt_len, ")"));
      }
      prev = p;
    }
  }
  return absl::OkStatus();
}

// A cuda_ipc chunk: its positions (checked) stored as grpc's are, then the rows the sender
// wrote into the pages checked by the checksum, computed on the cache's device.
absl::Status KvAssembler::CheckPlacedRows(const WireChunk& c) {
  StorePositions(c);
  ASSIGN_OR_RETURN(const uint32_t crc, PlacedChecksum(*cache_, c, header_.kept_per_layer[layer_]));
  if (crc != c.crc32c) {
    return absl::DataLossError(
        absl::StrCat(ChunkName(c), ": CRC-32C mismatch over the rows placed in the cache's pages"));
  }
  return absl::OkStatus();
}

absl::Status KvAssembler::CheckNext(const WireChunk& c) {
  if (failed_) return absl::FailedPreconditionError("KV stream already failed");
  if (absl::Status st = CheckChunk(c); !st.ok()) return Fail(st);
  return absl::OkStatus();
}

absl::Status KvAssembler::OnChunk(const WireChunk& c) {
  if (failed_) return absl::FailedPreconditionError("KV stream already failed");
  if (absl::Status st = CheckChunk(c); !st.ok()) return Fail(st);
  if (c.placed) {
    if (expect_.placement == KvPlacement::kRows) {
      if (absl::Status st = CheckPlacedRows(c); !st.ok()) return Fail(st);
    }
    Advance(c);
    return absl::OkStatus();
  }
  LayerCache& lc = cache_->layer(c.layer);
  const size_t row = lc.row_bytes();
  const KvFormat f = header_.kv_format;
  const int kept = header_.kept_per_layer[layer_];
  const size_t k_block =
      KvKeyBlockBytes(f, lc.dtype, lc.head_dim, kept, c.token_begin, c.token_count);
  const size_t v_block =
      KvValueBlockBytes(f, lc.dtype, lc.head_dim, kept, c.token_begin, c.token_count);
  const bool as_sent = f == KvFormat::kAuto || lc.coded();
  if (!as_sent) rows_.resize(2 * row * c.token_count);
  for (int h = 0; h < c.head_count; ++h) {
    const int head = c.head_begin + h;
    const auto* k = reinterpret_cast<const uint8_t*>(c.k.data()) + h * k_block;
    const auto* v = reinterpret_cast<const uint8_t*>(c.v.data()) + h * v_block;
    absl::Status st;
    if (lc.coded()) {
      // Kept as coded: the cache's groups are the stream's (KvGroups).
      st = cache_->WriteCodedBlock(c.layer, head, c.token_begin, c.token_count, k, v);
    } else {
      if (!as_sent) {
        // Dequantised into the cache's dtype.
        uint8_t* k_rows = rows_.data();
        uint8_t* v_rows = rows_.data() + row * c.token_count;
        DecodeKvKeys(f, lc.dtype, lc.head_dim, kept, c.token_begin, c.token_count, k, k_rows);
        DecodeKvValues(f, lc.dtype, lc.head_dim, kept, c.token_begin, c.token_count, v, v_rows);
        k = k_rows;
        v = v_rows;
      }
      // Into the cache's rows where they are: host memory, or a device's pages (staged copies).
      st = cache_->WriteRows(c.layer, head, c.token_begin, c.token_count, k, v);
    }
    if (!st.ok()) return Fail(st);
  }
  StorePositions(c);
  Advance(c);
  return absl::OkStatus();
}

// The chunk's positions, decoded and checked by CheckChunk, into the cache.
void KvAssembler::StorePositions(const WireChunk& c) {
  LayerCache& lc = cache_->layer(c.layer);
  for (int h = 0; h < c.head_count; ++h) {
    std::memcpy(lc.positions + int64_t{c.head_begin + h} * lc.capacity + c.token_begin,
                positions_.data() + static_cast<size_t>(h) * c.token_count,
                sizeof(int32_t) * c.token_count);
  }
}

// Past a chunk that was checked and is in the cache.
void KvAssembler::Advance(const WireChunk& c) {
  LayerCache& lc = cache_->layer(c.layer);
  const int kept = header_.kept_per_layer[layer_];
  payload_bytes_ += static_cast<int64_t>(c.payload_bytes());
  ++chunks_;
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
  if (t.cached_tokens < 0 || t.cached_tokens >= header_.prompt_len) {
    return Fail(
        Malformed(absl::StrCat("trailer: ", t.cached_tokens, " cached tokens of a prompt of ",
                               header_.prompt_len, " (the last is always computed)")));
  }
  complete_ = true;
  return absl::OkStatus();
}

}  // namespace kvwire
