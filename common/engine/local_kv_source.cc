#include "common/engine/local_kv_source.h"

#include <atomic>

namespace kvwire {
namespace {

// The engine's sink and the decode side's transfer handle in one: calls pass through.
class LocalTransfer final : public KvTransfer, public KvStreamSink {
 public:
  explicit LocalTransfer(std::shared_ptr<KvReceiver> receiver) : receiver_(std::move(receiver)) {}
  void Cancel() override { cancelled_.store(true); }
  absl::Status OnHeader(const WireHeader& header) override { return receiver_->OnHeader(header); }
  absl::Status OnChunk(WireChunk chunk) override { return receiver_->OnChunk(std::move(chunk)); }
  absl::Status OnTrailer(const WireTrailer& trailer) override {
    return receiver_->OnTrailer(trailer);
  }
  bool cancelled() const override { return cancelled_.load(); }
  void Done(const absl::Status& status) { receiver_->OnDone(status, 0); }

 private:
  std::shared_ptr<KvReceiver> receiver_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace

absl::StatusOr<std::shared_ptr<KvTransfer>> LocalKvSource::Start(
    PrefillJob job, std::shared_ptr<KvReceiver> receiver) {
  auto transfer = std::make_shared<LocalTransfer>(std::move(receiver));
  absl::Status st = prefills_->Submit(
      std::move(job), transfer, [transfer](const absl::Status& status) { transfer->Done(status); });
  if (!st.ok()) return st;
  return std::shared_ptr<KvTransfer>(transfer);
}

}  // namespace kvwire
