// `snapkv_pp`: SnapKV++, stage 1 of RocketKV (Behnam et al., "RocketKV: Accelerating Long-
// Context LLM Inference via Two-Stage KV Cache Compression", 2025), Algorithm 1. SnapKV
// with two changes: the votes of a GQA group's query heads are summed after the softmax
// and before pooling, so selection is per KV head and the cache is not duplicated; and the
// max-pooling kernel grows with the prompt (Appendix A.3: 63 below 48K tokens, 511 above).
//
// `rocketkv` is the two-stage method (§3.5): one per-step token budget split between this
// prompt compression and hybrid sparse attention at decode. Its split needs max_tokens,
// which only the decode side knows, so a `rocketkv` request is resolved into `snapkv_pp`
// with a derived budget plus a hybrid attention config by common/sparse/rocketkv.cc before
// any prompt is compressed; here it is registered with SnapKV++'s parameters.
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/compression/scoring.h"

namespace kvwire {
namespace {

absl::StatusOr<PolicyPtr> MakeSnapKVpp(const ParamValues& values);
absl::StatusOr<PolicyPtr> MakeRocketKV(const ParamValues& values);

std::vector<ParamInfo> ParamInfos() {
  return {
      {"kernel_small", "63", "snapkv_pp kernel below --kernel-threshold prompt tokens"},
      {"kernel_large", "511", "snapkv_pp kernel from --kernel-threshold prompt tokens on"},
      {"kernel_threshold", "49152", "snapkv_pp prompt length that switches kernels"},
  };
}

const PolicyInfo& Info() {
  static const PolicyInfo* const info = new PolicyInfo{
      "snapkv_pp", "group-summed votes, max-pooled with a kernel chosen by prompt length",
      "RocketKV, Algorithm 1 (SnapKV++)", ParamInfos(), &MakeSnapKVpp};
  return *info;
}

const PolicyInfo& RocketKVInfo() {
  static const PolicyInfo* const info = [] {
    std::vector<ParamInfo> params = ParamInfos();
    params.push_back({"budget_split", "alpha",
                      "rocketkv: how t is split between the stages: alpha (the authors' code) or "
                      "sqrt (the paper's √c per stage)"});
    return new PolicyInfo{
        "rocketkv",
        "one per-step token budget t split into SnapKV++ (stage 1) and hybrid attention (stage 2)",
        "RocketKV, §3.5", params, &MakeRocketKV};
  }();
  return *info;
}

struct SnapKVppParams {
  int kernel_small = 63;
  int kernel_large = 511;
  int kernel_threshold = 48 * 1024;
};

// SnapKV++'s parameters; the caller finishes the reader (rocketkv reads one more first).
absl::StatusOr<SnapKVppParams> ReadParams(ParamReader& reader) {
  SnapKVppParams p;
  RETURN_IF_ERROR(reader.Int("kernel_small", INT32_MIN, 1 << 20, &p.kernel_small));
  RETURN_IF_ERROR(reader.Int("kernel_large", INT32_MIN, 1 << 20, &p.kernel_large));
  RETURN_IF_ERROR(reader.Int("kernel_threshold", INT32_MIN, 1 << 30, &p.kernel_threshold));
  for (const auto& [name, kernel] : {std::pair<const char*, int>{"kernel_small", p.kernel_small},
                                     {"kernel_large", p.kernel_large}}) {
    if (kernel < 1 || kernel % 2 == 0) {
      return ParamError(name, absl::StrCat("must be odd and >= 1 (pooling pads kernel/2 each "
                                           "side), got ",
                                           kernel));
    }
  }
  if (p.kernel_threshold < 1) {
    return ParamError("kernel_threshold", absl::StrCat("must be >= 1, got ", p.kernel_threshold));
  }
  return p;
}

ParamValues ToValues(const SnapKVppParams& p) {
  return {{"kernel_small", absl::StrCat(p.kernel_small)},
          {"kernel_large", absl::StrCat(p.kernel_large)},
          {"kernel_threshold", absl::StrCat(p.kernel_threshold)}};
}

class SnapKVpp final : public CompressionPolicy {
 public:
  explicit SnapKVpp(SnapKVppParams p) : p_(p) {}
  const PolicyInfo& info() const override { return Info(); }
  ParamValues params() const override { return ToValues(p_); }
  std::string DescribeParams(int window) const override {
    return absl::StrCat(", window=", window, ", kernel=", p_.kernel_small, "/", p_.kernel_large,
                        "@", p_.kernel_threshold);
  }

  absl::StatusOr<const int32_t*> Select(const LayerInput& in, const SelectionOps& ops,
                                        PromptState*) const override {
    const int kernel = in.len >= p_.kernel_threshold ? p_.kernel_large : p_.kernel_small;
    return SelectByPooledVotes(in, ops, GqaMode::kSum, kernel, PoolKind::kMax);
  }

 private:
  SnapKVppParams p_;
};

// Not a selection on its own: the decode side resolves it (see the file comment).
class RocketKV final : public CompressionPolicy {
 public:
  RocketKV(SnapKVppParams p, std::string split) : p_(p), split_(std::move(split)) {}
  const PolicyInfo& info() const override { return RocketKVInfo(); }
  ParamValues params() const override {
    ParamValues v = ToValues(p_);
    v["budget_split"] = split_;
    return v;
  }
  bool selects() const override { return false; }
  std::string DescribeBudget(int budget, double) const override {
    return absl::StrCat("t=", budget);
  }
  std::string DescribeParams(int window) const override {
    return absl::StrCat(", window=", window, split_ == "alpha" ? "" : ", budget_split=" + split_);
  }
  absl::Status CheckBudget(int budget, int window) const override {
    // Stage 1 (SnapKV++) always keeps the window; a smaller budget would be raised to it
    // behind the caller's back, so it is refused as SnapKV's is.
    if (budget > 0 && budget <= window) {
      return absl::InvalidArgumentError(
          absl::StrCat("rocketkv's budget (the per-step token budget t, ", budget,
                       ") must exceed the observation window (", window,
                       ") that its first stage (SnapKV++) always keeps"));
    }
    // It becomes stage 2's attention token budget, which has this limit.
    if (budget > kMaxTokenBudget) {
      return absl::InvalidArgumentError(
          absl::StrCat("rocketkv's budget (the per-step token budget t, ", budget,
                       ") must be at most 2^26, the decode attention's token budget limit"));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<KeptRows> SelectPrefix(const LayerInput&, PromptState*) const override {
    return absl::FailedPreconditionError(
        "rocketkv must be resolved into its two stages (snapkv_pp + hybrid) before a prompt is "
        "compressed");
  }

 private:
  SnapKVppParams p_;
  std::string split_;
};

absl::StatusOr<PolicyPtr> MakeSnapKVpp(const ParamValues& values) {
  ParamReader reader(Info(), values);
  ASSIGN_OR_RETURN(SnapKVppParams p, ReadParams(reader));
  RETURN_IF_ERROR(reader.Finish());
  return std::make_shared<SnapKVpp>(p);
}

absl::StatusOr<PolicyPtr> MakeRocketKV(const ParamValues& values) {
  ParamReader reader(RocketKVInfo(), values);
  ASSIGN_OR_RETURN(SnapKVppParams p, ReadParams(reader));
  const std::vector<absl::string_view> splits = {"alpha", "sqrt"};
  int split = 0;
  RETURN_IF_ERROR(reader.Choice("budget_split", splits, &split));
  RETURN_IF_ERROR(reader.Finish());
  return std::make_shared<RocketKV>(p, std::string(splits[split]));
}

}  // namespace

const PolicyInfo& SnapKVppPolicyInfo() { return Info(); }
const PolicyInfo& RocketKVPolicyInfo() { return RocketKVInfo(); }

}  // namespace kvwire
