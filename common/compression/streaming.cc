// `streaming`: StreamingLLM's attention sinks (Xiao et al., "Efficient Streaming Language
// Models with Attention Sinks", ICLR 2024): the first `sinks` tokens plus the most recent
// budget - sinks, the observation window among them. Needs no scores.
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/compression/policy.h"

namespace kvwire {
namespace {

absl::StatusOr<PolicyPtr> MakeStreaming(const ParamValues& values);

const PolicyInfo& Info() {
  static const PolicyInfo* const info =
      new PolicyInfo{"streaming",
                     "the first `sinks` tokens + the most recent",
                     "StreamingLLM (attention sinks)",
                     {{"sinks", "4", "streaming attention sinks"}},
                     &MakeStreaming};
  return *info;
}

struct StreamingParams {
  int sinks = 4;
};

class Streaming final : public CompressionPolicy {
 public:
  explicit Streaming(StreamingParams p) : p_(p) {}
  const PolicyInfo& info() const override { return Info(); }
  ParamValues params() const override { return {{"sinks", absl::StrCat(p_.sinks)}}; }
  std::string DescribeParams(int window) const override {
    return absl::StrCat(", sinks=", p_.sinks);
  }
  bool uses_scores() const override { return false; }
  int MinBudget(int window) const override { return p_.sinks + window; }
  absl::Status CheckBudget(int budget, int window) const override {
    RETURN_IF_ERROR(CompressionPolicy::CheckBudget(budget, window));
    if (budget > 0 && budget < p_.sinks + window) {
      return absl::InvalidArgumentError(absl::StrCat("streaming budget (", budget,
                                                     ") must hold the sinks (", p_.sinks,
                                                     ") and the window (", window, ")"));
    }
    return absl::OkStatus();
  }

  // Sinks, then the prefix's most recent positions; the window follows them.
  absl::StatusOr<KeptRows> SelectPrefix(const LayerInput& in, PromptState*) const override {
    std::vector<int32_t> kept;
    for (int32_t j = 0; j < p_.sinks; ++j) kept.push_back(j);
    for (int32_t j = in.prefix - (in.prefix_budget - p_.sinks); j < in.prefix; ++j)
      kept.push_back(j);
    return KeptRows(in.cache_heads, kept);
  }

 private:
  StreamingParams p_;
};

absl::StatusOr<PolicyPtr> MakeStreaming(const ParamValues& values) {
  StreamingParams p;
  ParamReader reader(Info(), values);
  RETURN_IF_ERROR(reader.Int("sinks", 0, 1 << 20, &p.sinks));
  RETURN_IF_ERROR(reader.Finish());
  return std::make_shared<Streaming>(p);
}

}  // namespace

const PolicyInfo& StreamingPolicyInfo() { return Info(); }

}  // namespace kvwire
