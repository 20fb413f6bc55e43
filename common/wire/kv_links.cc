#include "common/wire/kv_links.h"

#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

std::string RandomHex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; ++i) absl::StrAppend(&out, absl::Hex(rd() & 0xff, absl::kZeroPad2));
  return out;
}

}  // namespace

KvLink::KvLink(kernels::KernelBackend* backend, std::unique_ptr<kernels::PeerLink> link,
               std::string name)
    : backend_(backend),
      link_(std::move(link)),
      name_(std::move(name)),
      used_(std::chrono::steady_clock::now()) {}

KvLink::~KvLink() {
  link_->Abort();
  backend_->Free(staging_);
}

absl::StatusOr<uint8_t*> KvLink::Staging(size_t bytes) {
  if (bytes > staging_bytes_) {
    backend_->Free(staging_);
    staging_ = nullptr;
    staging_bytes_ = 0;
    ASSIGN_OR_RETURN(staging_, backend_->Allocate(bytes));
    staging_bytes_ = bytes;
  }
  return static_cast<uint8_t*>(staging_);
}

absl::StatusOr<std::unique_ptr<KvLink>> SenderLinks::Acquire(const std::string& peer,
                                                             std::string* offer) {
  offer->clear();
  std::vector<std::unique_ptr<KvLink>> expired;  // aborted outside the lock
  std::string name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    for (auto it = idle_.begin(); it != idle_.end();) {
      auto& links = it->second;
      for (auto l = links.begin(); l != links.end();) {
        if (now - (*l)->used_ > kIdle) {
          expired.push_back(std::move(*l));
          l = links.erase(l);
        } else {
          ++l;
        }
      }
      it = links.empty() ? idle_.erase(it) : std::next(it);
    }
    if (auto it = idle_.find(peer); it != idle_.end()) {
      std::unique_ptr<KvLink> link = std::move(it->second.back());
      it->second.pop_back();
      if (it->second.empty()) idle_.erase(it);
      return link;
    }
    if (prefix_.empty()) prefix_ = RandomHex(8);
    name = absl::StrCat(prefix_, "-", ++made_);
  }
  ASSIGN_OR_RETURN(auto link, backend_->OpenLink(offer));
  return std::make_unique<KvLink>(backend_, std::move(link), std::move(name));
}

void SenderLinks::Release(const std::string& peer, std::unique_ptr<KvLink> link) {
  link->used_ = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  auto& links = idle_[peer];
  if (links.size() < kMaxIdlePerPeer) links.push_back(std::move(link));
}

int SenderLinks::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [peer, links] : idle_) n += static_cast<int>(links.size());
  return n;
}

absl::Status SenderLinks::Prepare(KvLink& link, const KvCache& cache, int kept, WireChunk* placed,
                                  std::vector<uint8_t>* message) {
  if (!cache.host_rows()) {
    return absl::InternalError("the nccl sender packs a cache whose rows are the host's");
  }
  const PlacedSpans spans = PlacedSpansOf(cache, *placed, kept);
  message->resize(static_cast<size_t>(spans.bytes));
  size_t at = 0;
  for (const kernels::ByteSpan& s : spans.spans) {
    std::memcpy(message->data() + at, s.data, static_cast<size_t>(s.bytes));
    at += static_cast<size_t>(s.bytes);
  }
  placed->link_seq = link.next_++;
  placed->link_bytes = spans.bytes;
  return absl::OkStatus();
}

absl::Status SenderLinks::Send(KvLink& link, const std::vector<uint8_t>& message,
                               std::chrono::milliseconds timeout) {
  if (message.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(uint8_t * staging, link.Staging(message.size()));
  RETURN_IF_ERROR(backend_->CopyToDevice(staging, message.data(), message.size()));
  RETURN_IF_ERROR(backend_->Synchronize());
  if (absl::Status st = link.link_->Send(staging, message.size(), timeout); !st.ok()) {
    return Annotate(st, absl::StrCat("sending on nccl link ", link.name()));
  }
  return absl::OkStatus();
}

ReceiverLinks::ReceiverLinks(kernels::KernelBackend* backend)
    : backend_(backend), peer_(absl::StrCat("decode-", RandomHex(8))) {}

absl::StatusOr<std::shared_ptr<KvLink>> ReceiverLinks::Use(const std::string& name,
                                                           const std::string& offer) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(
        "malformed KV stream: the nccl header names no link (or one over 128 bytes)");
  }
  std::vector<std::shared_ptr<KvLink>> expired;  // aborted outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  for (auto it = links_.begin(); it != links_.end();) {
    // Idle (no stream holds it) for longer than any prefill node keeps one.
    if (it->second.use_count() == 1 && now - it->second->used_ > kIdle) {
      expired.push_back(std::move(it->second));
      it = links_.erase(it);
    } else {
      ++it;
    }
  }
  auto it = links_.find(name);
  if (offer.empty()) {
    if (it == links_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the prefill node named nccl link ", name,
          ", which this decode node does not hold (it was dropped after a stream that did not "
          "end whole); the attempt is retried on a new link"));
    }
    it->second->used_ = now;
    return it->second;
  }
  if (it != links_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed KV stream: an offer for nccl link ", name, ", which is open"));
  }
  ASSIGN_OR_RETURN(auto joined, backend_->JoinLink(offer));
  auto link = std::make_shared<KvLink>(backend_, std::move(joined), name);
  links_[name] = link;
  return link;
}

void ReceiverLinks::Break(KvLink& link) {
  {
    std::lock_guard<std::mutex> lock(link.mu_);
    link.broken_ = true;
  }
  link.turn_.notify_all();
  link.link_->Abort();
}

void ReceiverLinks::Drop(const std::string& name, const std::shared_ptr<KvLink>& link) {
  Break(*link);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = links_.find(name); it != links_.end() && it->second == link) links_.erase(it);
}

void ReceiverLinks::Done(const std::shared_ptr<KvLink>& link, bool whole) {
  if (!whole) {
    Drop(link->name(), link);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  link->used_ = std::chrono::steady_clock::now();
}

int ReceiverLinks::open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(links_.size());
}

absl::Status ReceiverLinks::Receive(KvLink& link, const WireChunk& chunk, KvCache& cache, int kept,
                                    std::chrono::milliseconds timeout) {
  auto fail = [&](absl::Status st) {
    Break(link);
    return st;
  };
  if (cache.backend() != backend_) {
    return absl::FailedPreconditionError(
        "the nccl KV transport receives into a cache in this node's device pool");
  }
  const PlacedSpans spans = PlacedSpansOf(cache, chunk, kept);
  if (spans.bytes != chunk.link_bytes) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "malformed KV stream: a chunk of layer ", chunk.layer, " says its rows are ",
        chunk.link_bytes, " bytes on the link; the cache holds them in ", spans.bytes)));
  }
  {
    std::unique_lock<std::mutex> lock(link.mu_);
    const bool turn = link.turn_.wait_for(
        lock, timeout, [&] { return link.broken_ || link.next_ >= chunk.link_seq; });
    if (link.broken_) {
      return absl::UnavailableError(
          absl::StrCat("nccl link ", link.name(), " failed in another stream"));
    }
    if (!turn || link.next_ != chunk.link_seq) {
      lock.unlock();
      return fail(absl::DeadlineExceededError(
          absl::StrCat("nccl link ", link.name(), ": message ", chunk.link_seq, " was not next (",
                       link.next_, " is) within ", timeout.count(), " ms; the link was aborted")));
    }
  }
  // Our turn: no other stream touches the link until next_ moves on.
  absl::Status st = [&]() -> absl::Status {
    if (spans.bytes == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(uint8_t * staging, link.Staging(static_cast<size_t>(spans.bytes)));
    RETURN_IF_ERROR(link.link_->Recv(staging, static_cast<size_t>(spans.bytes), timeout));
    RETURN_IF_ERROR(backend_->PackSpans(
        {spans.spans.data(), static_cast<int>(spans.spans.size()), staging, /*unpack=*/true}));
    return backend_->Synchronize();
  }();
  if (!st.ok()) {
    return fail(Annotate(st, absl::StrCat("receiving on nccl link ", link.name())));
  }
  {
    std::lock_guard<std::mutex> lock(link.mu_);
    ++link.next_;
  }
  link.turn_.notify_all();
  return absl::OkStatus();
}

}  // namespace kvwire
