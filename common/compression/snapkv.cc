// `snapkv`: SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before
// Generation", NeurIPS 2024), Listing 1. The last `window` prompt queries vote: each
// prefix key gets the sum over the window of its attention probability (l.11); the votes
// are 1-D pooled (l.13: kernel k, stride 1, padding k/2, max or avg) so that a kept token
// brings its neighbours; the top budget - window prefix positions are kept per head,
// plus the whole window (l.15-19).
//
// Under GQA the paper's code selects per query head (`gqa=per_query_head`: the cache is
// n_rep times larger); per KV head, the group's votes are combined by sum (default),
// mean or max first. docs/algorithms.md §2 gives the specification.
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/compression/scoring.h"

namespace kvwire {
namespace {

absl::StatusOr<PolicyPtr> MakeSnapKV(const ParamValues& values);

const PolicyInfo& Info() {
  static const PolicyInfo* const info = new PolicyInfo{
      "snapkv",
      "top votes of the observation window after 1-D pooling, per KV head or per query head",
      "SnapKV (NeurIPS 2024), Listing 1",
      {{"pool", "max", "snapkv pooling: max or avg"},
       {"kernel", "7", "snapkv pooling kernel (odd; 1 = no pooling)"},
       {"gqa", "sum",
        "snapkv/hbw under GQA: per_query_head (original SnapKV), or per KV head with the "
        "group's votes combined by sum, mean or max"}},
      &MakeSnapKV};
  return *info;
}

struct SnapKVParams {
  PoolKind pool = PoolKind::kMax;
  int kernel = 7;
  GqaMode gqa = GqaMode::kSum;
};

class SnapKV final : public CompressionPolicy {
 public:
  explicit SnapKV(SnapKVParams p) : p_(p) {}
  const PolicyInfo& info() const override { return Info(); }
  ParamValues params() const override {
    return {{"pool", std::string(PoolNames()[static_cast<int>(p_.pool)])},
            {"kernel", absl::StrCat(p_.kernel)},
            {"gqa", std::string(GqaNames()[static_cast<int>(p_.gqa)])}};
  }
  int CacheHeads(int n_heads, int n_kv_heads) const override {
    return p_.gqa == GqaMode::kPerQueryHead ? n_heads : n_kv_heads;
  }

  absl::StatusOr<const int32_t*> Select(const LayerInput& in, const SelectionOps& ops,
                                        PromptState*) const override {
    return SelectByPooledVotes(in, ops, p_.gqa, p_.kernel, p_.pool);
  }

 private:
  SnapKVParams p_;
};

absl::StatusOr<PolicyPtr> MakeSnapKV(const ParamValues& values) {
  SnapKVParams p;
  int pool = static_cast<int>(p.pool), gqa = static_cast<int>(p.gqa);
  ParamReader reader(Info(), values);
  RETURN_IF_ERROR(reader.Choice("pool", PoolNames(), &pool));
  RETURN_IF_ERROR(reader.Int("kernel", INT32_MIN, 1 << 20, &p.kernel));
  RETURN_IF_ERROR(reader.Choice("gqa", GqaNames(), &gqa));
  RETURN_IF_ERROR(reader.Finish());
  if (p.kernel < 1 || p.kernel % 2 == 0) {
    return ParamError(
        "kernel",
        absl::StrCat("must be odd and >= 1 (pooling pads kernel/2 each side), got ", p.kernel));
  }
  p.pool = static_cast<PoolKind>(pool);
  p.gqa = static_cast<GqaMode>(gqa);
  return std::make_shared<SnapKV>(p);
}

}  // namespace

const PolicyInfo& SnapKVPolicyInfo() { return Info(); }

}  // namespace kvwire
