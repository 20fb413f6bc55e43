// `chunkkv`: ChunkKV (Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for
// Efficient Long-Context LLM Inference", 2025). Algorithm 1: the prefix is cut into
// chunks of `chunk` consecutive tokens, a chunk's score is the mean of its tokens' window
// votes, and whole chunks are kept best first, so kept tokens keep their context. The votes
// are summed over every query head and one index set serves the layer (chunk_scope=per_layer,
// as NVIDIA's kvpress does), or, as Algorithm 1 reads for one head, each KV head chooses
// its own chunks from its group's votes (chunk_scope=per_kv_head). Algorithm
// 2, layer-wise index reuse: layers in groups of `reuse_layers` share the first one's
// indices, and the later layers of a group need no scores at all.
//
// Choices the paper leaves open (docs/algorithms.md §5.3): chunks tile the prefix only
// (the window is appended whole, never chosen twice); chunks are taken in rank order
// until they cover the prefix budget, and the last one taken is cut to fit exactly. (The
// literal Algorithm 1 line 16 cuts the position-sorted tokens instead, which cuts the
// chunk nearest the window however well it ranks: a needle near the end of the prompt.)
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/ranking.h"
#include "common/base/status.h"
#include "common/compression/scoring.h"

namespace kvwire {
namespace {

absl::StatusOr<PolicyPtr> MakeChunkKV(const ParamValues& values);

const PolicyInfo& Info() {
  static const PolicyInfo* const info = new PolicyInfo{
      "chunkkv",
      "whole chunks of `chunk` tokens, one index set per layer, shared by `reuse_layers` layers",
      "ChunkKV, Algorithms 1-2",
      {{"chunk", "10", "chunkkv chunk size"},
       {"reuse_layers", "1", "chunkkv layer-wise index reuse group size (1: none)"},
       {"chunk_scope", "per_layer",
        "chunkkv: one index set per layer from all heads' votes (per_layer), or one per KV "
        "head from its group's (per_kv_head)"}},
      &MakeChunkKV};
  return *info;
}

const std::vector<absl::string_view> kScopes = {"per_layer", "per_kv_head"};

struct ChunkKVParams {
  int chunk = 10;        // tokens per chunk (ChunkKV §4)
  int reuse_layers = 1;  // N_reuse
  bool per_kv_head = false;
};

// Whole chunks best first; the last one taken (the lowest ranked) is cut to its first
// tokens to fill the budget exactly, so a better chunk is never cut.
std::vector<int32_t> ChunkSelect(const std::vector<float>& tok, int chunk, int prefix_budget) {
  const int prefix = static_cast<int>(tok.size());
  std::vector<std::pair<int32_t, int>> chosen;  // chunk, tokens taken from its start
  int covered = 0;
  for (int32_t m : RankBestFirst(RunMeans(tok, chunk))) {
    if (covered >= prefix_budget) break;
    const int take =
        std::min(std::min(prefix, (m + 1) * chunk) - m * chunk, prefix_budget - covered);
    chosen.push_back({m, take});
    covered += take;
  }
  std::sort(chosen.begin(), chosen.end());
  std::vector<int32_t> kept;
  for (const auto& [m, take] : chosen) {
    for (int j = m * chunk; j < m * chunk + take; ++j) kept.push_back(j);
  }
  return kept;
}

class ChunkKV final : public CompressionPolicy {
 public:
  explicit ChunkKV(ChunkKVParams p) : p_(p) {}
  const PolicyInfo& info() const override { return Info(); }
  ParamValues params() const override {
    return {{"chunk", absl::StrCat(p_.chunk)},
            {"reuse_layers", absl::StrCat(p_.reuse_layers)},
            {"chunk_scope", std::string(kScopes[p_.per_kv_head ? 1 : 0])}};
  }
  // Only the first layer of each reuse group scores (Algorithm 2).
  bool NeedsScores(int index) const override { return index % p_.reuse_layers == 0; }

  absl::StatusOr<KeptRows> SelectPrefix(const LayerInput& in, PromptState* state) const override {
    if (!NeedsScores(in.index)) {
      if (state->carried.empty()) {
        return absl::FailedPreconditionError("chunkkv: reused layer before its anchor");
      }
      return state->carried;
    }
    std::vector<std::vector<float>> votes = HeadVotes(*in.scores, in.prefix);
    if (p_.per_kv_head) {
      state->carried.clear();
      for (const auto& row : GroupVotes(std::move(votes), GqaMode::kSum, in.n_kv_heads)) {
        state->carried.push_back(ChunkSelect(row, p_.chunk, in.prefix_budget));
      }
      return state->carried;
    }
    std::vector<float> tok(in.prefix, 0.f);
    for (const auto& row : votes) {
      for (int j = 0; j < in.prefix; ++j) tok[j] += row[j];
    }
    state->carried = KeptRows(in.cache_heads, ChunkSelect(tok, p_.chunk, in.prefix_budget));
    return state->carried;
  }

 private:
  ChunkKVParams p_;
};

absl::StatusOr<PolicyPtr> MakeChunkKV(const ParamValues& values) {
  ChunkKVParams p;
  int scope = 0;
  ParamReader reader(Info(), values);
  RETURN_IF_ERROR(reader.Int("chunk", INT32_MIN, 1 << 20, &p.chunk));
  RETURN_IF_ERROR(reader.Int("reuse_layers", INT32_MIN, 1 << 20, &p.reuse_layers));
  RETURN_IF_ERROR(reader.Choice("chunk_scope", kScopes, &scope));
  p.per_kv_head = scope == 1;
  RETURN_IF_ERROR(reader.Finish());
  if (p.chunk < 1) return ParamError("chunk", absl::StrCat("must be >= 1, got ", p.chunk));
  if (p.reuse_layers < 1) {
    return ParamError("reuse_layers",
                      absl::StrCat("must be >= 1 (1: no reuse), got ", p.reuse_layers));
  }
  return std::make_shared<ChunkKV>(p);
}

}  // namespace

const PolicyInfo& ChunkKVPolicyInfo() { return Info(); }

}  // namespace kvwire
