// The KvSource of a decode node's own model: prefills on a PrefillExecutor (the node's local
// PrefillEngine) and hands the stream straight to the receiver.
#pragma once

#include <memory>

#include "common/engine/kv_source.h"
#include "common/engine/prefill_engine.h"

namespace kvwire {

// Prefills on a PrefillExecutor of this process (the decode node's own model) and hands
// the stream straight to the receiver: no serialization, no copies beyond the chunks.
class LocalKvSource final : public KvSource {
 public:
  explicit LocalKvSource(PrefillExecutor* prefills) : prefills_(prefills) {}
  absl::string_view name() const override { return "local"; }
  absl::StatusOr<std::shared_ptr<KvTransfer>> Start(PrefillJob job,
                                                    std::shared_ptr<KvReceiver> receiver) override;

 private:
  PrefillExecutor* prefills_;
};

}  // namespace kvwire
