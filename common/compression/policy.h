// The interface every prompt-compression policy implements, and the registry that lists
// them by name (the CLI's help and flags, the protobuf translation, `kvwire policies` and
// the docs all read it).
//
// A policy owns its parameters (a struct of its own, parsed from named values), its
// scoring, and a citation of its paper; each lives in one file of this folder:
//
//   full.cc       no eviction
//   streaming.cc  attention sinks + the most recent tokens (StreamingLLM)
//   random.cc     uniform random prefix positions (a baseline)
//   snapkv.cc     SnapKV, Listing 1
//   snapkv_pp.cc  SnapKV++ (RocketKV Algorithm 1), and the prompt side of `rocketkv`
//   chunkkv.cc    ChunkKV, Algorithms 1-2
//   hbw.cc        HBW-KV, block-wise and hierarchical selection
//
// What every policy shares is written once, in compression.cc: the budget (tokens kept
// per cache head, the observation window included), the window rule (the last `window`
// prompt positions are always kept, whatever the scores), short prompts kept whole, the
// dense first `skip_layers` layers, and the gather of the kept K/V rows. A policy only
// chooses, per layer, which positions of the prefix [0, len - window) to keep. Those that
// score (SnapKV and its family, ChunkKV, HBW-KV) do it with the backend's selection ops
// (kernels/selection.h), in the backend's memory, as kvpress's scorer presses do: the policy
// scores, the shared ops rank (TopK, in common/base/ranking.h's order) and gather; scoring
// steps they share are in scoring.h. Those that need no scores (streaming, random) choose on
// the host, and their choice is uploaded.
//
// Adding a policy: one new file that defines its PolicyInfo and class, and one line in
// registry.cc.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace kvwire {

// A policy's parameters by name ("kernel" → "7"), as they come from flags, a request or
// an eval method spec. A policy reads the ones it takes; any other is an error.
using ParamValues = std::map<std::string, std::string>;

// A double as text that parses back to the same double ("%.17g"), for ParamValues.
std::string ExactDecimal(double x);

// Errors about one parameter are InvalidArgument "<param> <what>" carrying the parameter's
// name (and, for one the policy does not take, the policy's) as payloads, so that callers
// name it their way: a flag (--kernel-small) or a request field (compression.kernel_small).
absl::Status ParamError(absl::string_view param, absl::string_view what);
// `status` marked as being about `param` (RenameParams renames its first mention).
absl::Status AboutParam(absl::Status status, absl::string_view param);
// "<param> does not apply to <policy> (it takes a, b); <param> applies to c".
absl::Status NotTakenError(absl::string_view param, absl::string_view policy);
// The same status with every parameter name it carries written by `name`, and about the field
// `name` gives it (FieldOf); a status without the payloads is returned as it is.
absl::Status RenameParams(const absl::Status& status,
                          const std::function<std::string(absl::string_view)>& name);

// One ascending row of kept prompt positions per cache head.
using KeptRows = std::vector<std::vector<int32_t>>;

// SnapKV-family scoring of one layer: the observation-window attention probabilities
// [n_heads, window, len] (PrefillAttentionParams::window_scores).
struct WindowScores {
  const float* data = nullptr;
  int n_heads = 0;
  int window = 0;
  int len = 0;
};

// What a policy sees of one layer when it chooses.
struct LayerInput {
  int layer = 0;          // model layer
  int index = 0;          // among the compressed layers (layer - skip_layers)
  int len = 0;            // prompt tokens
  int window = 0;         // the observation window: positions [prefix, len), always kept
  int prefix = 0;         // len - window: the positions a policy chooses among
  int prefix_budget = 0;  // how many of them each cache head keeps (< prefix)
  int n_heads = 0, n_kv_heads = 0;
  int cache_heads = 0;                   // rows to return
  const WindowScores* scores = nullptr;  // null when NeedsScores(index) is false
};

// A policy's memory across the layers of one prompt: ChunkKV's reused index sets, kept in
// SelectionOps::carried.
struct PromptState {
  bool has_carried = false;
};

// Where a policy computes one layer's selection: the backend whose memory holds the layer's
// window scores (LayerInput::scores), and buffers there, sized for the prompt.
struct SelectionOps {
  kernels::KernelBackend* backend = nullptr;
  float* votes = nullptr;   // [n_heads, prefix] floats of scratch
  float* pooled = nullptr;  // [n_heads, prefix] floats of scratch
  // [cache_heads, budget]: each row's prefix_budget chosen positions in ascending order, then
  // the window's positions [prefix, len).
  int32_t* kept = nullptr;
  int32_t* carried = nullptr;  // the same shape, kept across the prompt's layers
};

// The largest per-step token budget of decode attention (DecodeAttentionConfig's
// token_budget and top_k), which rocketkv's budget becomes (common/sparse/rocketkv.h).
inline constexpr int kMaxTokenBudget = 1 << 26;

class CompressionPolicy;
using PolicyPtr = std::shared_ptr<const CompressionPolicy>;

struct ParamInfo {
  const char* name;           // "kernel_small": flag --kernel-small, proto field kernel_small
  const char* default_value;  // as text
  const char* help;
};

struct PolicyInfo {
  const char* name;   // as in its paper: snapkv, snapkv_pp, chunkkv, hbw, ...
  const char* keeps;  // one line: what it keeps
  const char* paper;  // where it comes from
  std::vector<ParamInfo> params;
  // Builds the policy from named parameter values (defaults for the missing ones).
  absl::StatusOr<PolicyPtr> (*make)(const ParamValues& values);
};

class CompressionPolicy {
 public:
  virtual ~CompressionPolicy() = default;

  virtual const PolicyInfo& info() const = 0;
  absl::string_view name() const { return info().name; }
  // Every parameter it takes, with its value: MakePolicy(name(), params()) rebuilds it.
  virtual ParamValues params() const { return {}; }
  // How Describe shows the budget ("budget=64", "ratio=0.25") and the parameters after it
  // (", window=16, kernel=7").
  virtual std::string DescribeBudget(int budget, double ratio) const;
  virtual std::string DescribeParams(int window) const;

  // false for `full`, which keeps every prompt token.
  virtual bool evicts() const { return true; }
  // Whether it reads observation-window scores at all, and for the index-th compressed layer.
  virtual bool uses_scores() const { return true; }
  virtual bool NeedsScores(int index) const { return uses_scores(); }
  // Cache heads: the KV heads, or the query heads for a selection per query head.
  virtual int CacheHeads(int n_heads, int n_kv_heads) const { return n_kv_heads; }
  // The least budget a ratio gives for this window (the window plus one prefix token).
  virtual int MinBudget(int window) const { return window + 1; }
  // Checks an explicit budget against this policy's needs.
  virtual absl::Status CheckBudget(int budget, int window) const;
  // False for a policy that must be resolved before a prompt is compressed (rocketkv).
  virtual bool selects() const { return true; }

  // One layer's kept positions in backend memory (SelectionOps::kept's layout): written to
  // ops.kept, or to ops.carried for a selection later layers reuse, and that buffer returned.
  // The default uploads SelectPrefix's choice (a policy that chooses on the host).
  virtual absl::StatusOr<const int32_t*> Select(const LayerInput& in, const SelectionOps& ops,
                                                PromptState* state) const;
  // A policy that chooses on the host: in.cache_heads ascending rows of in.prefix_budget
  // distinct positions in [0, in.prefix). The scoring policies choose with ops (Select) and
  // do not implement it.
  virtual absl::StatusOr<KeptRows> SelectPrefix(const LayerInput& in, PromptState* state) const;
};

// Reads a policy's parameters from named values: each accessor reads one (keeping the
// default in *out when it is absent) and checks its form; Finish reports any value no
// accessor read, which does not apply to this policy. Messages name the parameter first
// ("kernel must be odd ..."), so callers can prefix "compression." or "--".
class ParamReader {
 public:
  ParamReader(const PolicyInfo& info, const ParamValues& values) : info_(info), values_(values) {}

  // An integer in [min, max].
  absl::Status Int(const char* name, int min, int max, int* out);
  absl::Status Uint64(const char* name, uint64_t* out);
  // Comma-separated integers, each in [min, max], 1..max_items of them.
  absl::Status IntList(const char* name, int min, int max, size_t max_items, std::vector<int>* out);
  // One of `names`; *out becomes its index.
  absl::Status Choice(const char* name, const std::vector<absl::string_view>& names, int* out);
  absl::Status Finish() const;

 private:
  const std::string* Take(const char* name);

  const PolicyInfo& info_;
  const ParamValues& values_;
  std::vector<std::string> read_;
};

// The registry, in the order the docs list policies.
const std::vector<const PolicyInfo*>& Policies();
// nullptr when no policy has that name.
const PolicyInfo* FindPolicy(absl::string_view name);
// "full, streaming, random, snapkv, snapkv_pp, chunkkv, hbw, rocketkv"
std::string PolicyNames();
// The policies that take parameter `param`, comma-separated.
std::string PoliciesTaking(absl::string_view param);
// A policy by name with parameters (defaults for the rest). InvalidArgument for an
// unknown name, a malformed value, or a parameter the policy does not take.
absl::StatusOr<PolicyPtr> MakePolicy(absl::string_view name, const ParamValues& params = {});
// The `full` policy (keeps everything), shared.
PolicyPtr FullPolicy();

}  // namespace kvwire
