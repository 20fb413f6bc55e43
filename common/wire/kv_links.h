// The nccl KV transport's links, on both nodes (KernelBackend::OpenLink: NCCL on a GPU, a
// loopback socket on the guarded backend). The Prefill stream stays the control channel: the
// header names the stream's link (with an offer when it is new), each chunk's message carries
// the sequence number and size of the message that follows it on the link, which holds the
// chunk's rows as the decode cache holds them (PlacedSpansOf, packed), and the decode node
// receives them into its pages before it checks the chunk's PlacedChecksum.
//
// A link carries one stream at a time (the prefill node lends it out), so a stream's messages
// are the link's in order; the sequence numbers keep the decode node's receives in the
// prefill node's order across the hand-over from one stream to the next, where NCCL may have
// taken the last stream's bytes before its receive was posted. A link is kept, on either
// node, only after a stream that ended whole (its trailer read): after anything else the two
// ends may disagree about what is in flight, and it is aborted.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/wire/kv_wire.h"
#include "kernels/backend.h"

namespace kvwire {

// One end of a link, with the backend memory its messages are packed in.
class KvLink {
 public:
  KvLink(kernels::KernelBackend* backend, std::unique_ptr<kernels::PeerLink> link,
         std::string name);
  ~KvLink();
  const std::string& name() const { return name_; }

 private:
  friend class SenderLinks;
  friend class ReceiverLinks;
  absl::StatusOr<uint8_t*> Staging(size_t bytes);

  kernels::KernelBackend* const backend_;
  const std::unique_ptr<kernels::PeerLink> link_;
  const std::string name_;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  std::chrono::steady_clock::time_point used_;
  // Sender: the next message's number. Receiver: the next message to receive, and whether the
  // link failed (every waiting stream then fails too).
  std::mutex mu_;
  std::condition_variable turn_;
  uint64_t next_ = 0;
  bool broken_ = false;
};

// The prefill node's links, per decode node (its link_peer name): lent to one stream at a
// time, made on demand, kept warm while idle for up to kIdle (fewer than the decode node's
// kIdle, so it never names one the decode node has closed for being idle).
class SenderLinks {
 public:
  static constexpr auto kIdle = std::chrono::seconds(30);
  static constexpr size_t kMaxIdlePerPeer = 8;

  explicit SenderLinks(kernels::KernelBackend* backend) : backend_(backend) {}

  // A link to `peer` for one stream: an idle one, or a new one whose offer goes into `*offer`
  // (empty for an idle one).
  absl::StatusOr<std::unique_ptr<KvLink>> Acquire(const std::string& peer, std::string* offer);
  // Back from a stream that ended whole; any other end just drops the link (aborted).
  void Release(const std::string& peer, std::unique_ptr<KvLink> link);
  // `placed`'s rows in `cache` (host rows: the prefill node assembles the stream on the host),
  // packed: the message that follows the chunk on `link`. Sets placed->link_seq, link_bytes.
  absl::Status Prepare(KvLink& link, const KvCache& cache, int kept, WireChunk* placed,
                       std::vector<uint8_t>* message);
  // The message on the link, once the chunk's message is on the stream.
  absl::Status Send(KvLink& link, const std::vector<uint8_t>& message,
                    std::chrono::milliseconds timeout);
  int idle() const;

 private:
  kernels::KernelBackend* const backend_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<std::unique_ptr<KvLink>>> idle_;
  uint64_t made_ = 0;
  std::string prefix_;  // this process's, in every link name
};

// The decode node's links, by the prefill node's name for each.
class ReceiverLinks {
 public:
  static constexpr auto kIdle = std::chrono::seconds(120);

  // `peer`: this node's name in its requests (random).
  explicit ReceiverLinks(kernels::KernelBackend* backend);
  const std::string& peer() const { return peer_; }

  // The link a stream's header names, joined first when the header offers it.
  absl::StatusOr<std::shared_ptr<KvLink>> Use(const std::string& name, const std::string& offer);
  // The stream on `link` ended, whole or not; a link kept after a whole one.
  void Done(const std::shared_ptr<KvLink>& link, bool whole);
  // Receives `chunk`'s rows (checked by the receiver's assembler first: its rectangle is the
  // next of the stream) into `cache`, whose layer holds `kept` prompt tokens: waits for the
  // chunk's turn on the link (up to `timeout`, as the receive itself), checks the message's
  // size against the cache's spans, receives and unpacks it.
  absl::Status Receive(KvLink& link, const WireChunk& chunk, KvCache& cache, int kept,
                       std::chrono::milliseconds timeout);
  int open() const;

 private:
  // Marks `link` failed (every stream waiting for its turn fails too) and aborts it.
  static void Break(KvLink& link);
  void Drop(const std::string& name, const std::shared_ptr<KvLink>& link);

  kernels::KernelBackend* const backend_;
  const std::string peer_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<KvLink>> links_;
};

}  // namespace kvwire
