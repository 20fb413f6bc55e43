// `full`: no eviction; every prompt token's K/V goes to decode. The baseline every other
// policy is measured against (docs/fidelity.md).
#include "common/compression/policy.h"

namespace kvwire {
namespace {

absl::StatusOr<PolicyPtr> MakeFull(const ParamValues& values);

const PolicyInfo& Info() {
  static const PolicyInfo* const info =
      new PolicyInfo{"full", "every prompt token", "baseline", {}, &MakeFull};
  return *info;
}

class Full final : public CompressionPolicy {
 public:
  const PolicyInfo& info() const override { return Info(); }
  bool evicts() const override { return false; }
  bool uses_scores() const override { return false; }
  absl::StatusOr<KeptRows> SelectPrefix(const LayerInput&, PromptState*) const override {
    return absl::InternalError("full keeps every prompt token; nothing to select");
  }
};

absl::StatusOr<PolicyPtr> MakeFull(const ParamValues& values) {
  ParamReader reader(Info(), values);
  if (absl::Status st = reader.Finish(); !st.ok()) return st;
  return std::make_shared<Full>();
}

}  // namespace

const PolicyInfo& FullPolicyInfo() { return Info(); }

}  // namespace kvwire
