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
#include "common/base/ranking.h"
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

// Whole blocks per round (docs/algorithms.md §6.2): the prefix budget holds ⌊budget/T⌋ whole
// blocks; the rounds share them equally (earlier rounds one more when they do not divide),
// each round spreads its blocks over its M groups equally (earlier groups one more), and each
// group takes its best blocks that no earlier round took. Blocks a group cannot take (too few
// left in it) and the remainder smaller than a block go to the fill below: the best remaining
// blocks, the last one cut to fit, so that exactly `prefix_budget` tokens are kept.
std::vector<int32_t> HbwSelect(const std::vector<float>& tok, int block,
                               const std::vector<int>& rounds, int prefix_budget) {
  const int prefix = static_cast<int>(tok.size());
  const int n_blocks = (prefix + block - 1) / block;
  auto block_size = [&](int b) { return std::min(prefix, (b + 1) * block) - b * block; };
  const std::vector<int32_t> rank = RankBestFirst(RunMeans(tok, block));
  std::vector<int> rank_of(n_blocks);
  for (int r = 0; r < n_blocks; ++r) rank_of[rank[r]] = r;
  std::vector<bool> selected(n_blocks, false);
  int used = 0;
  const int whole = prefix_budget / block;
  const int n_rounds = static_cast<int>(rounds.size());
  for (int r = 0; r < n_rounds; ++r) {
    const int round_blocks = whole / n_rounds + (r < whole % n_rounds ? 1 : 0);
    const int m_groups = std::min(rounds[r], n_blocks);
    for (int g = 0; g < m_groups; ++g) {
      const int quota = round_blocks / m_groups + (g < round_blocks % m_groups ? 1 : 0);
      const int b0 = static_cast<int>(int64_t{g} * n_blocks / m_groups);
      const int b1 = static_cast<int>(int64_t{g + 1} * n_blocks / m_groups);
      std::vector<int32_t> cand;
      for (int b = b0; b < b1; ++b) {
        if (!selected[b]) cand.push_back(b);
      }
      std::sort(cand.begin(), cand.end(), [&](int a, int b) { return rank_of[a] < rank_of[b]; });
      int taken = 0;
      for (int32_t b : cand) {
        if (taken == quota || used + block_size(b) > prefix_budget) break;
        selected[b] = true;
        ++taken;
        used += block_size(b);
      }
    }
  }
  int partial_block = -1, partial_len = 0;
  for (int32_t b : rank) {
    if (used >= prefix_budget) break;
    if (selected[b]) continue;
    if (used + block_size(b) <= prefix_budget) {
      selected[b] = true;
      used += block_size(b);
    } else {
      partial_block = b;
      partial_len = prefix_budget - used;
      used = prefix_budget;
    }
  }
  std::vector<int32_t> kept;
  for (int b = 0; b < n_blocks; ++b) {
    const int len = selected[b] ? block_size(b) : (b == partial_block ? partial_len : 0);
    for (int j = b * block; j < b * block + len; ++j) kept.push_back(j);
  }
  return kept;
}

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

  absl::StatusOr<KeptRows> SelectPrefix(const LayerInput& in, PromptState*) const override {
    const int budget = in.prefix_budget + in.window;
    const int block = p_.block > 0 ? p_.block : std::max(1, budget / 32);
    KeptRows kept;
    for (const auto& row : GroupVotes(HeadVotes(*in.scores, in.prefix), p_.gqa, in.n_kv_heads)) {
      kept.push_back(HbwSelect(row, block, p_.groups, in.prefix_budget));
    }
    return kept;
  }

 private:
  HbwParams p_;
};

absl::StatusOr<PolicyPtr> MakeHbw(const ParamValues& values) {
  HbwParams p;
  int gqa = static_cast<int>(p.gqa);
  ParamReader reader(Info(), values);
  RETURN_IF_ERROR(reader.Int("block", INT32_MIN, 1 << 20, &p.block));
  RETURN_IF_ERROR(reader.IntList("groups", 1, 1 << 20, 64, &p.groups));
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
