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
#include <vector>

#include "absl/strings/str_cat.h"
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

  // Chunk scores are the means of the tokens' votes (RunMeans); whole chunks are taken best
  // first, the last one cut to its first tokens: TopK over tokens whose runs of `chunk` share
  // the chunk's score. Written to ops.carried, which the reusing layers return.
  absl::StatusOr<const int32_t*> Select(const LayerInput& in, const SelectionOps& ops,
                                        PromptState* state) const override {
    if (!NeedsScores(in.index)) {
      if (!state->has_carried) {
        return absl::FailedPreconditionError("chunkkv: reused layer before its anchor");
      }
      return ops.carried;
    }
    // One row of votes for the layer (every query head summed), or one per KV head.
    kernels::WindowVotesParams v;
    v.scores = in.scores->data;
    v.n_heads = in.n_heads;
    v.window = in.scores->window;
    v.len = in.len;
    v.prefix = in.prefix;
    v.group = p_.per_kv_head ? in.n_heads / in.n_kv_heads : in.n_heads;
    v.votes = ops.votes;
    RETURN_IF_ERROR(ops.backend->WindowVotes(v));
    const int rows = in.n_heads / v.group, chunks = (in.prefix + p_.chunk - 1) / p_.chunk;
    RETURN_IF_ERROR(ops.backend->RunMeans({ops.votes, ops.pooled, rows, in.prefix, p_.chunk}));
    std::vector<kernels::TopKSegment> segs(in.cache_heads);
    for (int c = 0; c < in.cache_heads; ++c) {
      kernels::TopKSegment& s = segs[c];
      s.score = ops.pooled + int64_t{p_.per_kv_head ? c : 0} * chunks;
      s.n = in.prefix;
      s.run = p_.chunk;
      s.k = in.prefix_budget;
      s.append = in.window;
      s.out = ops.carried + int64_t{c} * (in.prefix_budget + in.window);
    }
    RETURN_IF_ERROR(ops.backend->TopK({segs.data(), in.cache_heads, /*ascending=*/true}));
    state->has_carried = true;
    return ops.carried;
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
