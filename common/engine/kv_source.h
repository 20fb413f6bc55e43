// Where a decode node gets a prompt's compressed KV cache. The decode engine asks a
// KvSource to start a prefill and hears the resulting stream through its KvReceiver:
//
//   GrpcKvSource   (decode_service/grpc_kv_source.h) a prefill node over the Prefill RPC
//   LocalKvSource  (local_kv_source.h) this node's own model, for short prompts or no prefill
//                  nodes
//   fakes          (tests/) streams a test scripts, with no network
//
// Transports that move the rows into the receiver's own buffers plug in here: the stream's
// metadata as on grpc, the rows written where the cache lies (shm, cuda_ipc, nccl).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/engine/prefill_job.h"
#include "common/wire/kv_stream.h"

namespace kvwire {

// The receiving end of one stream: its calls in order (on the source's threads; they must
// not block for long), then OnDone exactly once, last.
class KvReceiver : public KvStreamSink {
 public:
  // The cache the stream goes into, for a source that writes the rows there itself
  // (KvSource::placement); null where the receiver stores them.
  virtual KvCache* destination() { return nullptr; }
  // Whether `chunk` is the stream's next and well formed, before a source that writes its rows
  // into destination() itself writes them (nccl: the link's receive); OnChunk follows. A
  // receiver that cannot tell refuses.
  virtual absl::Status CheckChunk(const WireChunk& chunk) {
    return absl::FailedPreconditionError("this receiver does not check chunks before their rows");
  }
  // How the stream ended, and the bytes its transport moved.
  virtual void OnDone(const absl::Status& status, int64_t transport_bytes) = 0;
};

// A stream in flight. Cancel may be called from any thread, any number of times, also
// after the stream ended; the receiver still hears OnDone.
class KvTransfer {
 public:
  virtual ~KvTransfer() = default;
  virtual void Cancel() = 0;
  // Where the attempt went and how it was chosen ("affinity", "fallback", "round_robin"), for
  // the trace and metrics; empty where the source does not choose among nodes.
  virtual std::string node() const { return {}; }
  virtual std::string route() const { return {}; }
};

class KvSource {
 public:
  virtual ~KvSource() = default;
  // "grpc", "shm", "local", ...: the transport label of metrics.
  virtual absl::string_view name() const = 0;
  // Whether the source writes into the receiver's cache itself, and what: rows and positions
  // (shm: the cache must be in a shared host region, KvPool::AllocateShared), or rows (cuda_ipc:
  // the cache in a device pool's pages). Every chunk then arrives placed (WireExpectation).
  virtual KvPlacement placement() const { return KvPlacement::kNone; }
  // Whether a node whose attempt failed may still write into the cache until the attempt's
  // deadline, its lease (cuda_ipc: the prefill node writes the pages itself; nccl's rows land
  // only in receives this node posts, so not): the engine then keeps that attempt's pages out
  // of the pool until the lease ends.
  virtual bool leases_cache() const { return placement() == KvPlacement::kRows; }
  // Starts pulling `job`'s KV into `receiver`. An error here means nothing started and the
  // receiver hears nothing; otherwise it hears the stream and then OnDone. Never calls the
  // receiver on the caller's thread before returning.
  virtual absl::StatusOr<std::shared_ptr<KvTransfer>> Start(
      PrefillJob job, std::shared_ptr<KvReceiver> receiver) = 0;
};

}  // namespace kvwire
