// `hbw`: HBW-KV ("Training-Free Native Sparse Attention for KV Cache Compression").
// Block-wise selection (§3.2.2, Eq. 5): the prefix is cut into blocks of T tokens (T =
// budget / 32 by default, §4.4.1) scored by the mean of their tokens' votes; whole blocks
// are kept. Hierarchical selection (§3.2.3, Eq. 6): rounds in turn split the prefix into
// M groups (e.g. M = 1, then 8), each group choosing its best blocks not yet chosen, so
// kept blocks spread over the prompt instead of piling at its ends.
//
// The paper leaves the share of each round open; here the rounds share the budget's whole
// blocks equally, each spreading its blocks over its groups, so the M = 8 round keeps as many
// blocks as the M = 1 round, spread over the prompt (docs/algorithms.md §6.2-6.3).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/compression/scoring.h"

namespace kvwire {
namespace {

absl::StatusOr<PolicyPtr> MakeHbw(const ParamValues& values);

const PolicyInfo& Info() {
  static const PolicyInfo* const info = new PolicyInfo{
      "hbw",
      "blocks of budget/32 tokens, hierarchical rounds over `groups` (1,8)",
      "HBW-KV, §3.2",
      {{"block", "0", "hbw block size (0: budget / 32)"},
       {"groups", "1,8", "hbw hierarchical rounds: group counts M per round"},
       {"gqa", "sum",
        "snapkv/hbw under GQA: per_query_head (original SnapKV), or per KV head with the "
        "group's votes combined by sum, mean or max"}},
      &MakeHbw};
  return *info;
}

struct HbwParams {
  int block = 0;                     // block size T; 0: budget / 32
  std::vector<int> groups = {1, 8};  // group count M of each round
  GqaMode gqa = GqaMode::kSum;
};

class Hbw final : public CompressionPolicy {
 public:
  explicit Hbw(HbwParams p) : p_(std::move(p)) {}
  const PolicyInfo& info() const override { return Info(); }
  ParamValues params() const override {
    return {{"block", absl::StrCat(p_.block)},
            {"groups", absl::StrJoin(p_.groups, ",")},
            {"gqa", std::string(GqaNames()[static_cast<int>(p_.gqa)])}};
  }
  std::string DescribeParams(int window) const override {
    std::string s =
        absl::StrCat(", window=", window,
                     ", block=", p_.block == 0 ? std::string("budget/32") : absl::StrCat(p_.block),
                     ", groups=", absl::StrJoin(p_.groups, ","));
    if (p_.gqa != GqaMode::kSum)
      absl::StrAppend(&s, ", gqa=", GqaNames()[static_cast<int>(p_.gqa)]);
    return s;
  }
  int CacheHeads(int n_heads, int n_kv_heads) const override {
    return p_.gqa == GqaMode::kPerQueryHead ? n_heads : n_kv_heads;
  }

  // Whole blocks per round (docs/algorithms.md §6.2): the prefix budget holds ⌊budget/T⌋ whole
  // blocks; the rounds share them equally (earlier rounds one more when they do not divide),
  // each round spreads its blocks over its M groups equally (earlier groups one more), and each
  // group takes its best blocks that no earlier round took. Blocks a group cannot take (too few
  // left in it) and the remainder smaller than a block go to the fill: the best remaining
  // blocks, the last one cut to fit, so that exactly `prefix_budget` tokens are kept
  // (kernels::HbwSelect).
  absl::StatusOr<const int32_t*> Select(const LayerInput& in, const SelectionOps& ops,
                                        PromptState*) const override {
    const int budget = in.prefix_budget + in.window;
    const int block = p_.block > 0 ? p_.block : std::max(1, budget / 32);
    RETURN_IF_ERROR(GroupVotes(in, ops, p_.gqa));
    RETURN_IF_ERROR(
        ops.backend->RunMeans({ops.votes, ops.pooled, in.cache_heads, in.prefix, block}));
    kernels::HbwSelectParams h;
    h.block_scores = ops.pooled;
    h.rows = in.cache_heads;
    h.prefix = in.prefix;
    h.block = block;
    h.prefix_budget = in.prefix_budget;
    h.append = in.window;
    for (int m : p_.groups) h.rounds[h.n_rounds++] = m;
    h.out = ops.kept;
    RETURN_IF_ERROR(ops.backend->HbwSelect(h));
    return ops.kept;
  }

 private:
  HbwParams p_;
};

absl::StatusOr<PolicyPtr> MakeHbw(const ParamValues& values) {
  HbwParams p;
  int gqa = static_cast<int>(p.gqa);
  ParamReader reader(Info(), values);
  RETURN_IF_ERROR(reader.Int("block", INT32_MIN, 1 << 20, &p.block));
  RETURN_IF_ERROR(reader.IntList("groups", 1, 1 << 20, kernels::kMaxHbwRounds, &p.groups));
  RETURN_IF_ERROR(reader.Choice("gqa", GqaNames(), &gqa));
  RETURN_IF_ERROR(reader.Finish());
  if (p.block < 0) {
    return ParamError("block", absl::StrCat("must be >= 0 (0: budget/32), got ", p.block));
  }
  p.gqa = static_cast<GqaMode>(gqa);
  return std::make_shared<Hbw>(p);
}

}  // namespace

const PolicyInfo& HbwPolicyInfo() { return Info(); }

}  // namespace kvwire
