// The compressed KV cache on the wire (format version 3), independent of the transport:
// a header, per-layer chunks bounded in size and checksummed, a trailer. The services
// translate these to and from the protobuf messages of proto/kvwire/v1/kv.proto; this file
// owns the rules: how a layer is cut into chunks, what the CRC-32C covers, and how a
// receiver checks every field before a byte reaches the decode node's cache.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/crc32c.h"
#include "common/base/kv_format.h"
#include "common/compression/compression.h"
#include "common/model/kv_cache.h"

namespace kvwire {

inline constexpr uint32_t kWireFormatVersion = 3;
inline constexpr size_t kDefaultMaxChunkBytes = 1 << 20;
// A receiver refuses chunks above this, whatever the sender claims.
inline constexpr size_t kMaxChunkBytesLimit = 16 << 20;

// How a stream's K/V rows travel between the nodes; the Prefill stream carries everything
// else (header, chunk rectangles and checksums, trailer, errors, cancellation) either way.
//   grpc      in the stream's chunks (any two hosts)
//   shm       written by the prefill node into the decode node's cache, a shared host region
//   cuda_ipc  written by the prefill node into the decode node's pool pages on the GPU (one
//             host; the pool's slab mapped through CUDA IPC); positions still in the chunks
//   nccl      sent by the prefill node on a link (NCCL between GPUs, any two hosts; a
//             KernelBackend::OpenLink) and received by the decode node into its pool pages;
//             positions still in the chunks
enum class KvTransport : uint8_t { kGrpc = 0, kShm = 1, kCudaIpc = 2, kNccl = 3 };
absl::string_view KvTransportName(KvTransport t);
// "grpc", "shm", "cuda_ipc" or "nccl".
absl::StatusOr<KvTransport> ParseKvTransport(absl::string_view name);
// A decode node's name for its links (nccl: the prefill nodes keep links per name): 1 to 64
// letters, digits, '-' or '_'.
bool IsLinkPeerName(absl::string_view name);

struct WireHeader {
  uint32_t format_version = kWireFormatVersion;
  std::string model_fingerprint;
  int num_layers = 0;
  int num_cache_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;             // the cache's: what rows decode into
  KvFormat kv_format = KvFormat::kAuto;  // how K and V rows are coded (common/base/kv_format.h)
  std::string policy;
  int prompt_len = 0;
  std::vector<int> kept_per_layer;
  // nccl: the link the rows travel on (the prefill node's name for it), and the offer the
  // decode node joins it with when it is new (empty: a link both already hold).
  std::string link_name;
  std::string link_offer;
};

struct WireChunk {
  int layer = 0;
  int head_begin = 0, head_count = 0;
  int token_begin = 0, token_count = 0;
  std::string positions;  // per head, the token_count positions coded (EncodePositions)
  std::string k, v;       // [head_count, token_count] rows in the header's kv_format
  uint32_t crc32c = 0;
  // Written into the receiver's cache where it lies, not carried: k and v are empty (and on shm
  // the positions too, which lie in the cache), crc32c is PlacedChecksum's, placed_bytes the
  // payload the chunk stands for (what grpc would carry).
  bool placed = false;
  int64_t placed_bytes = 0;
  // nccl: the rows follow on the stream's link as one message of link_bytes (PlacedSpans'
  // bytes, packed), the link_seq-th since the link was made.
  uint64_t link_seq = 0;
  int64_t link_bytes = 0;

  size_t payload_bytes() const {
    return placed ? static_cast<size_t>(placed_bytes) : positions.size() + k.size() + v.size();
  }
};

struct WireTrailer {
  int32_t first_token = 0;
  float first_logprob = 0;
  double forward_ms = 0;
  double compress_ms = 0;
  int64_t full_cache_bytes = 0;
  int64_t kv_payload_bytes = 0;
  int chunks = 0;
  std::string node;
  int cached_tokens = 0;  // prompt tokens whose K/V the prefill node's prefix cache held
};

// The checksum a chunk carries: over its five rectangle fields (int32 LE), positions, K, V.
uint32_t ChunkChecksum(const WireChunk& chunk);

// The checksum of a placed chunk: its five rectangle fields (int32 LE), then per head its
// positions (int32 LE) and the CRC-32Cs (uint32 LE) of its rows as `cache` holds them, one per
// row (K then V per token; a coded cache's code rows), then (coded) one over the parameters and
// one over the fp8 scales of the key groups the tokens touch. Both nodes compute it over the
// same memory (the prefill node after writing, the decode node before it uses the rows); the
// rows' CRCs where the rows are, on the cache's backend for a device cache (ChecksumSpans), so
// a GPU's rows never cross to the host. `kept` is the layer's prompt tokens.
// What the sender of chunk `c` sends once it has written c into the receiver's cache `cache`:
// c's rectangle, placed, standing for c's payload, with c's positions where they travel
// (`with_positions`: cuda_ipc) and the checksum of what the cache holds.
absl::StatusOr<WireChunk> PlacedChunk(const WireChunk& c, const KvCache& cache, int kept,
                                      bool with_positions);
absl::StatusOr<uint32_t> PlacedChecksum(const KvCache& cache, const WireChunk& chunk, int kept);
// The memory PlacedChecksum covers for a chunk, in its order: per head its rows (K then V per
// token) and (coded) its groups' parameters and scales; `head_end[i]` is where head
// head_begin + i's spans end. What the nccl transport packs into one message (the same spans,
// of the same sizes, on both nodes however each lays the cache out).
struct PlacedSpans {
  std::vector<kernels::ByteSpan> spans;
  std::vector<size_t> head_end;
  int64_t bytes = 0;
};
PlacedSpans PlacedSpansOf(const KvCache& cache, const WireChunk& chunk, int kept);

// One head's strictly ascending positions, coded as whichever is smaller (a tie: deltas):
//   0x00, then n LEB128 varints: the first position, then each gap less one
//   0x01, varint first, varint span (last - first + 1), then span bits LSB-first, set where
//         first + i is kept
void EncodePositions(const int32_t* positions, int n, std::string* out);
// Decodes one head's n positions from in[*offset...], advancing *offset; anything but n
// strictly ascending positions in [0, prompt_len) is an error naming what was wrong.
absl::Status DecodePositions(absl::string_view in, size_t* offset, int n, int prompt_len,
                             int32_t* positions);

// Cuts a layer into chunks of at most `max_bytes` payload each: whole heads packed
// together where they fit, a head's tokens split where one head alone does not; K and V
// coded in `format`. Chunks come in order (heads, then tokens) and carry their checksums.
std::vector<WireChunk> ChunkLayer(const CompressedLayer& layer, KvFormat format, size_t max_bytes);

// Whether a stream's sender writes into the receiving cache itself:
//   kNone               the chunks carry the rows (grpc)
//   kRowsAndPositions   rows and positions are in the cache (shm: the whole cache is shared)
//   kRows               rows are in the cache (cuda_ipc: the pool's pages; nccl: received into
//                       them), positions in the chunks, stored by the receiver as grpc's are
enum class KvPlacement : uint8_t { kNone, kRowsAndPositions, kRows };
KvPlacement PlacementOf(KvTransport t);

// What the receiving node expects of a stream, fixed before it starts.
struct WireExpectation {
  std::string model_fingerprint;
  int num_layers = 0;
  int num_cache_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;
  KvFormat kv_format = KvFormat::kAuto;  // what the request asked for
  int prompt_len = 0;
  std::vector<int> kept_per_layer;  // what the request's compression keeps (empty: unchecked)
  size_t max_chunk_bytes = kDefaultMaxChunkBytes;
  // Whether the sender writes into the cache itself (then every chunk is placed, and the
  // receiver checks what the cache holds).
  KvPlacement placement = KvPlacement::kNone;
};

// What a receiver that trusts a header's own shape expects of its stream (the placing sinks,
// which check chunks as the decode node will; StreamExpectation adds the request's limits).
WireExpectation ExpectHeader(const WireHeader& h);

// Receives one stream into a cache reserved for it. Chunks must tile each layer in
// order; anything else (a wrong field, an overlap, a gap, a bad checksum, a position out
// of order or out of the prompt) is an error that says what was wrong and leaves the
// stream unusable. Checksum failures are DataLoss; other malformations InvalidArgument.
class KvAssembler {
 public:
  KvAssembler(WireExpectation expect, KvCache* cache);

  absl::Status OnHeader(const WireHeader& header);
  absl::Status OnChunk(const WireChunk& chunk);
  // OnChunk's checks of `chunk` as the stream's next, without taking it: what a transport that
  // writes its rows into the cache by another way checks before it writes (nccl's receive).
  absl::Status CheckNext(const WireChunk& chunk);
  // Every layer complete and the trailer sane.
  absl::Status OnTrailer(const WireTrailer& trailer, int vocab_size);

  bool header_seen() const { return header_seen_; }
  bool complete() const { return complete_; }
  int64_t payload_bytes() const { return payload_bytes_; }
  int chunks() const { return chunks_; }
  const WireHeader& header() const { return header_; }

 private:
  absl::Status Fail(absl::Status status);
  absl::Status CheckChunk(const WireChunk& chunk);
  absl::Status CheckPlaced(const WireChunk& chunk, const std::string& where);
  absl::Status DecodeChunkPositions(const WireChunk& chunk, const std::string& where);
  absl::Status CheckPlacedRows(const WireChunk& chunk);
  void StorePositions(const WireChunk& chunk);
  void Advance(const WireChunk& chunk);

  WireExpectation expect_;
  KvCache* cache_;
  WireHeader header_;
  bool header_seen_ = false, complete_ = false, failed_ = false;
  int layer_ = 0, head_ = 0, token_ = 0;  // where the next chunk must start
  int64_t payload_bytes_ = 0;
  int chunks_ = 0;
  std::vector<int32_t> positions_;  // the chunk's, decoded by CheckChunk
  std::vector<uint8_t> rows_;       // its K and V rows dequantised
};

}  // namespace kvwire
