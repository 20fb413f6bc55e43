// One compressed-KV stream in domain terms, whatever carries it: a header, then chunks
// layer by layer (layer l while layer l+1 computes), then a trailer with the first token.
// The prefill engine writes one into a KvStreamSink; the prefill node's sink translates it
// to gRPC messages, the decode node's receiver (or an in-process one) assembles it into a
// KV cache. The same interface on both ends is what lets a transport (gRPC today, NCCL or
// CUDA IPC later) plug in between them.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/wire/kv_wire.h"

namespace kvwire {

class KvStreamSink {
 public:
  virtual ~KvStreamSink() = default;
  // In stream order. Each may block (backpressure); an error ends the stream with it.
  virtual absl::Status OnHeader(const WireHeader& header) = 0;
  virtual absl::Status OnChunk(WireChunk chunk) = 0;
  virtual absl::Status OnTrailer(const WireTrailer& trailer) = 0;
  // The reader went away: a writer checks between layers and stops.
  virtual bool cancelled() const { return false; }
  // What carries the stream and the bytes it moved, for metrics and traces.
  virtual absl::string_view transport() const { return "local"; }
  virtual int64_t transport_bytes() const { return 0; }
};

// Receives a stream into a KV cache reserved for it, checking everything (KvAssembler):
// the in-process end of a stream.
class CacheStreamSink final : public KvStreamSink {
 public:
  CacheStreamSink(WireExpectation expect, KvCache* cache, int vocab_size)
      : assembler_(std::move(expect), cache), vocab_size_(vocab_size) {}
  absl::Status OnHeader(const WireHeader& header) override { return assembler_.OnHeader(header); }
  absl::Status OnChunk(WireChunk chunk) override { return assembler_.OnChunk(chunk); }
  absl::Status OnTrailer(const WireTrailer& trailer) override {
    return assembler_.OnTrailer(trailer, vocab_size_);
  }
  const KvAssembler& assembler() const { return assembler_; }

 private:
  KvAssembler assembler_;
  int vocab_size_;
};

}  // namespace kvwire
