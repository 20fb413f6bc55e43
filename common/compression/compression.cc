#include "common/compression/compression.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("compression: ", what));
}

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> v(std::max(0, end - begin));
  std::iota(v.begin(), v.end(), begin);
  return v;
}

// Indices of the n largest scores, ties broken towards the lower position (max-pooling
// makes plateaus of equal scores, so ties are common and must be deterministic),
// returned in ascending position order.
std::vector<int32_t> TopK(const std::vector<float>& scores, int n) {
  std::vector<int32_t> idx = Range(0, static_cast<int32_t>(scores.size()));
  n = std::min<int>(n, static_cast<int>(idx.size()));
  auto better = [&](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + n, idx.end(), better);
  idx.resize(n);
  std::sort(idx.begin(), idx.end());
  return idx;
}

// Ranks items by score (desc), ties to the lower index.
std::vector<int32_t> Ranking(const std::vector<float>& scores) {
  std::vector<int32_t> idx = Range(0, static_cast<int32_t>(scores.size()));
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  return idx;
}

// SnapKV Listing 1, l.13: pool1d(vote, kernel, padding=kernel//2, stride=1). Max pooling
// pads with -inf; average pooling counts the padding (divides by the kernel), as
// PyTorch's avg_pool1d does by default.
std::vector<float> Pool(const std::vector<float>& x, int kernel, PoolKind kind) {
  const int n = static_cast<int>(x.size()), half = kernel / 2;
  if (kernel <= 1) return x;
  std::vector<float> out(n);
  for (int j = 0; j < n; ++j) {
    const int lo = std::max(0, j - half), hi = std::min(n - 1, j + half);
    if (kind == PoolKind::kMax) {
      float m = -std::numeric_limits<float>::infinity();
      for (int i = lo; i <= hi; ++i) m = std::max(m, x[i]);
      out[j] = m;
    } else {
      float s = 0.f;
      for (int i = lo; i <= hi; ++i) s += x[i];
      out[j] = s / static_cast<float>(kernel);
    }
  }
  return out;
}

// SnapKV Listing 1, l.11: vote[h][j] = Σ over window queries of the attention on prefix
// key j (the window's own columns are not voted on: the window is kept whole).
std::vector<std::vector<float>> HeadVotes(const WindowScores& s, int prefix) {
  std::vector<std::vector<float>> votes(s.n_heads, std::vector<float>(prefix, 0.f));
  for (int h = 0; h < s.n_heads; ++h) {
    for (int i = 0; i < s.window; ++i) {
      const float* row = s.data + (int64_t{h} * s.window + i) * s.len;
      for (int j = 0; j < prefix; ++j) votes[h][j] += row[j];
    }
  }
  return votes;
}

// Combines query-head votes into one row per cache head (RocketKV Alg. 1 sums the group
// after the softmax and before pooling).
std::vector<std::vector<float>> GroupVotes(std::vector<std::vector<float>> votes, GqaMode mode,
                                           int n_kv_heads) {
  if (mode == GqaMode::kPerQueryHead) return votes;
  const int group = static_cast<int>(votes.size()) / n_kv_heads;
  const size_t prefix = votes.empty() ? 0 : votes[0].size();
  std::vector<std::vector<float>> out(n_kv_heads, std::vector<float>(prefix, 0.f));
  for (int g = 0; g < n_kv_heads; ++g) {
    for (size_t j = 0; j < prefix; ++j) {
      float acc = mode == GqaMode::kMax ? -std::numeric_limits<float>::infinity() : 0.f;
      for (int x = 0; x < group; ++x) {
        const float v = votes[g * group + x][j];
        acc = mode == GqaMode::kMax ? std::max(acc, v) : acc + v;
      }
      out[g][j] = mode == GqaMode::kMean ? acc / group : acc;
    }
  }
  return out;
}

// Appends the observation window [prefix, len) to a sorted prefix selection.
std::vector<int32_t> WithWindow(std::vector<int32_t> kept, int prefix, int len) {
  for (int32_t j = prefix; j < len; ++j) kept.push_back(j);
  return kept;
}

// ChunkKV Algorithm 1 with the choices of docs/algorithms.md §5.3: chunks tile the prefix
// only (the window is always appended, so it is never chosen twice), a chunk's score is
// the mean of its tokens' votes, chunks are taken in rank order until they cover the
// prefix budget, and the position-sorted tokens are cut to exactly that budget.
std::vector<int32_t> ChunkSelect(const std::vector<float>& tok, int chunk, int prefix_budget) {
  const int prefix = static_cast<int>(tok.size());
  const int n_chunks = (prefix + chunk - 1) / chunk;
  std::vector<float> score(n_chunks);
  for (int m = 0; m < n_chunks; ++m) {
    const int lo = m * chunk, hi = std::min(prefix, lo + chunk);
    float s = 0.f;
    for (int j = lo; j < hi; ++j) s += tok[j];
    score[m] = s / static_cast<float>(hi - lo);
  }
  std::vector<int32_t> chosen;
  int covered = 0;
  for (int32_t m : Ranking(score)) {
    if (covered >= prefix_budget) break;
    chosen.push_back(m);
    covered += std::min(prefix, (m + 1) * chunk) - m * chunk;
  }
  std::sort(chosen.begin(), chosen.end());
  std::vector<int32_t> kept;
  for (int32_t m : chosen) {
    for (int j = m * chunk; j < std::min(prefix, (m + 1) * chunk); ++j) kept.push_back(j);
  }
  kept.resize(std::min<size_t>(kept.size(), prefix_budget));
  return kept;
}

// HBW-KV §3.2.2-3.2.3: block scores are the mean of their tokens' votes (Eq. 5); each
// round splits the prefix into M groups (snapped to blocks) with an equal share of the
// round's capacity and picks each group's best unselected blocks (Eq. 6). Rounds share
// the capacity equally (the paper leaves this open; docs/algorithms.md §6.3). Capacity a
// round could not use in whole blocks goes to the best remaining blocks, the last one
// cut to fit, so exactly `prefix_budget` tokens are kept.
std::vector<int32_t> HbwSelect(const std::vector<float>& tok, int block,
                               const std::vector<int>& rounds, int prefix_budget) {
  const int prefix = static_cast<int>(tok.size());
  const int n_blocks = (prefix + block - 1) / block;
  auto block_size = [&](int b) { return std::min(prefix, (b + 1) * block) - b * block; };
  std::vector<float> score(n_blocks);
  for (int b = 0; b < n_blocks; ++b) {
    float s = 0.f;
    for (int j = b * block; j < b * block + block_size(b); ++j) s += tok[j];
    score[b] = s / static_cast<float>(block_size(b));
  }
  const std::vector<int32_t> rank = Ranking(score);
  std::vector<int> rank_of(n_blocks);
  for (int r = 0; r < n_blocks; ++r) rank_of[rank[r]] = r;
  std::vector<bool> selected(n_blocks, false);
  int used = 0;
  const int n_rounds = static_cast<int>(rounds.size());
  for (int r = 0; r < n_rounds; ++r) {
    const int round_cap = prefix_budget / n_rounds + (r < prefix_budget % n_rounds ? 1 : 0);
    const int m_groups = std::min(rounds[r], n_blocks);
    for (int g = 0; g < m_groups; ++g) {
      const int cap = round_cap / m_groups + (g < round_cap % m_groups ? 1 : 0);
      const int b0 = static_cast<int>(int64_t{g} * n_blocks / m_groups);
      const int b1 = static_cast<int>(int64_t{g + 1} * n_blocks / m_groups);
      std::vector<int32_t> cand;
      for (int b = b0; b < b1; ++b) {
        if (!selected[b]) cand.push_back(b);
      }
      std::sort(cand.begin(), cand.end(), [&](int a, int b) { return rank_of[a] < rank_of[b]; });
      int taken = 0;
      for (int32_t b : cand) {
        if (taken + block_size(b) > cap || used + block_size(b) > prefix_budget) break;
        selected[b] = true;
        taken += block_size(b);
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

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// n distinct positions of [0, prefix), uniformly (partial Fisher-Yates), sorted.
std::vector<int32_t> RandomSelect(int prefix, int n, uint64_t seed) {
  std::vector<int32_t> all = Range(0, prefix);
  uint64_t state = seed;
  for (int i = 0; i < n; ++i) {
    state = Mix(state);
    const int j = i + static_cast<int>(state % static_cast<uint64_t>(prefix - i));
    std::swap(all[i], all[j]);
  }
  all.resize(n);
  std::sort(all.begin(), all.end());
  return all;
}

}  // namespace

absl::string_view PolicyName(Policy p) {
  switch (p) {
    case Policy::kFull:
      return "full";
    case Policy::kStreaming:
      return "streaming";
    case Policy::kRandom:
      return "random";
    case Policy::kSnapKV:
      return "snapkv";
    case Policy::kSnapKVpp:
      return "snapkv_pp";
    case Policy::kChunkKV:
      return "chunkkv";
    case Policy::kHBW:
      return "hbw";
    case Policy::kRocketKV:
      return "rocketkv";
  }
  return "?";
}

std::string PolicyNames() {
  return "full, streaming, random, snapkv, snapkv_pp, chunkkv, hbw, rocketkv";
}

absl::StatusOr<Policy> ParsePolicy(absl::string_view name) {
  for (Policy p : {Policy::kFull, Policy::kStreaming, Policy::kRandom, Policy::kSnapKV,
                   Policy::kSnapKVpp, Policy::kChunkKV, Policy::kHBW, Policy::kRocketKV}) {
    if (name == PolicyName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown compression policy '", name, "'; expected one of ", PolicyNames()));
}

absl::string_view PoolName(PoolKind p) { return p == PoolKind::kMax ? "max" : "avg"; }

absl::StatusOr<PoolKind> ParsePool(absl::string_view name) {
  if (name == "max") return PoolKind::kMax;
  if (name == "avg") return PoolKind::kAvg;
  return absl::InvalidArgumentError(absl::StrCat("unknown pooling '", name, "'; expected max or avg"));
}

absl::string_view GqaName(GqaMode g) {
  switch (g) {
    case GqaMode::kPerQueryHead:
      return "per_query_head";
    case GqaMode::kSum:
      return "sum";
    case GqaMode::kMean:
      return "mean";
    case GqaMode::kMax:
      return "max";
  }
  return "?";
}

absl::StatusOr<GqaMode> ParseGqa(absl::string_view name) {
  for (GqaMode g : {GqaMode::kPerQueryHead, GqaMode::kSum, GqaMode::kMean, GqaMode::kMax}) {
    if (name == GqaName(g)) return g;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown GQA mode '", name, "'; expected per_query_head, sum, mean or max"));
}

absl::Status CompressionConfig::Validate() const {
  if (budget < 0) return Bad(absl::StrCat("budget must be >= 0, got ", budget));
  if (!(ratio >= 0 && ratio <= 1)) {
    return Bad(absl::StrCat("ratio must be in (0, 1] (kept / prompt tokens), got ", ratio));
  }
  // Upper bounds keep every sum below int overflow and every buffer sane; the window also
  // bounds the score buffer (heads × window × prompt floats per layer).
  constexpr int kMaxParam = 1 << 20;
  if (budget > (1 << 30)) return Bad(absl::StrCat("budget must be <= 2^30, got ", budget));
  if (window > kMaxWindow) {
    return Bad(absl::StrCat("window must be <= ", kMaxWindow, " (observation windows are 16-128 "
                            "tokens in the papers), got ", window));
  }
  for (const auto& [name, v] : std::vector<std::pair<const char*, int>>{
           {"kernel", kernel}, {"kernel_small", kernel_small}, {"kernel_large", kernel_large},
           {"chunk", chunk}, {"block", block}, {"sinks", sinks}, {"reuse_layers", reuse_layers},
           {"skip_layers", skip_layers}}) {
    if (v > kMaxParam) return Bad(absl::StrCat(name, " must be <= 2^20, got ", v));
  }
  if (groups.size() > 64) return Bad(absl::StrCat("at most 64 groups, got ", groups.size()));
  for (int g : groups) {
    if (g > kMaxParam) return Bad(absl::StrCat("groups must be <= 2^20, got ", g));
  }
  if (policy == Policy::kFull) return absl::OkStatus();
  if (budget == 0 && ratio == 0) {
    return Bad(absl::StrCat(PolicyName(policy), " needs a budget (tokens kept per head) or a ratio"));
  }
  if (skip_layers < 0) return Bad(absl::StrCat("skip_layers must be >= 0, got ", skip_layers));
  if (window < 1) return Bad(absl::StrCat("window must be >= 1, got ", window));
  if (budget > 0 && budget <= window && policy != Policy::kRocketKV) {
    return Bad(absl::StrCat("budget (", budget, ") must exceed the observation window (", window,
                            "), which is always kept"));
  }
  if (gqa != GqaMode::kSum && policy != Policy::kSnapKV && policy != Policy::kHBW) {
    return Bad(absl::StrCat("gqa applies to snapkv and hbw only; ", PolicyName(policy),
                            " selects per KV head"));
  }
  switch (policy) {
    case Policy::kSnapKV:
      if (kernel < 1 || kernel % 2 == 0) {
        return Bad(absl::StrCat("kernel must be odd and >= 1 (pooling pads kernel/2 each side), "
                                "got ",
                                kernel));
      }
      break;
    case Policy::kSnapKVpp:
      if (kernel_small < 1 || kernel_small % 2 == 0 || kernel_large < 1 || kernel_large % 2 == 0) {
        return Bad(absl::StrCat("kernel_small and kernel_large must be odd and >= 1, got ",
                                kernel_small, " and ", kernel_large));
      }
      if (kernel_threshold < 1) return Bad("kernel_threshold must be >= 1");
      break;
    case Policy::kChunkKV:
      if (chunk < 1) return Bad(absl::StrCat("chunk must be >= 1, got ", chunk));
      if (reuse_layers < 1) {
        return Bad(absl::StrCat("reuse_layers must be >= 1 (1: no reuse), got ", reuse_layers));
      }
      break;
    case Policy::kHBW:
      if (block < 0) return Bad(absl::StrCat("block must be >= 0 (0: budget/32), got ", block));
      if (groups.empty()) return Bad("groups must list at least one round (e.g. 1,8)");
      for (int g : groups) {
        if (g < 1) return Bad(absl::StrCat("groups must be >= 1, got ", g));
      }
      break;
    case Policy::kRocketKV:
      if (budget < 2) {
        return Bad(absl::StrCat("rocketkv needs budget = the per-step token budget t (>= 2), got ",
                                budget));
      }
      break;
    case Policy::kStreaming:
      if (sinks < 0) return Bad(absl::StrCat("sinks must be >= 0, got ", sinks));
      if (budget > 0 && budget < sinks + window) {
        return Bad(absl::StrCat("streaming budget (", budget, ") must hold the sinks (", sinks,
                                ") and the window (", window, ")"));
      }
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

int CompressionConfig::EffectiveBudget(int len) const {
  if (policy == Policy::kFull) return len;
  if (budget > 0) return budget;
  const int floor = policy == Policy::kStreaming ? sinks + window : window + 1;
  return std::max(floor, static_cast<int>(std::floor(ratio * len)));
}

bool CompressionConfig::Compresses(int len) const {
  return policy != Policy::kFull && len > EffectiveBudget(len);
}

int CompressionConfig::KeptTokens(int layer, int len) const {
  // rocketkv is resolved into snapkv_pp before a prompt is compressed.
  KVWIRE_CHECK(policy != Policy::kRocketKV);
  if (layer < skip_layers || !Compresses(len)) return len;
  return EffectiveBudget(len);
}

int CompressionConfig::CacheHeads(int n_heads, int n_kv_heads) const {
  return gqa == GqaMode::kPerQueryHead ? n_heads : n_kv_heads;
}

bool CompressionConfig::NeedsScores() const {
  return policy == Policy::kSnapKV || policy == Policy::kSnapKVpp || policy == Policy::kChunkKV ||
         policy == Policy::kHBW || policy == Policy::kRocketKV;
}

std::string CompressionConfig::Describe() const {
  if (policy == Policy::kFull) return "full";
  std::string s = absl::StrCat(PolicyName(policy), "(",
                               budget > 0 ? absl::StrCat("budget=", budget)
                                          : absl::StrCat("ratio=", ratio));
  if (policy != Policy::kStreaming) absl::StrAppend(&s, ", window=", window);
  switch (policy) {
    case Policy::kSnapKV:
      absl::StrAppend(&s, ", pool=", PoolName(pool), ", kernel=", kernel, ", gqa=", GqaName(gqa));
      break;
    case Policy::kSnapKVpp:
      absl::StrAppend(&s, ", kernel=", kernel_small, "/", kernel_large, "@", kernel_threshold);
      break;
    case Policy::kChunkKV:
      absl::StrAppend(&s, ", chunk=", chunk, ", reuse_layers=", reuse_layers);
      break;
    case Policy::kHBW:
      absl::StrAppend(&s, ", block=", block == 0 ? std::string("budget/32") : absl::StrCat(block),
                      ", groups=", absl::StrJoin(groups, ","));
      if (gqa != GqaMode::kSum) absl::StrAppend(&s, ", gqa=", GqaName(gqa));
      break;
    case Policy::kStreaming:
      absl::StrAppend(&s, ", sinks=", sinks);
      break;
    case Policy::kRandom:
      absl::StrAppend(&s, ", seed=", seed);
      break;
    case Policy::kRocketKV:
      return absl::StrCat("rocketkv(t=", budget, ", window=", window, ")");
    default:
      break;
  }
  if (skip_layers > 0) absl::StrAppend(&s, ", skip_layers=", skip_layers);
  return s + ")";
}

LayerSelector::LayerSelector(const CompressionConfig& config, int n_heads, int n_kv_heads)
    : config_(config), n_heads_(n_heads), n_kv_heads_(n_kv_heads) {}

bool LayerSelector::NeedsScoresFor(int layer, int len) const {
  if (!config_.NeedsScores() || layer < config_.skip_layers || !config_.Compresses(len)) {
    return false;
  }
  if (config_.policy == Policy::kChunkKV) {
    return (layer - config_.skip_layers) % config_.reuse_layers == 0;
  }
  return true;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> LayerSelector::Select(
    int layer, int len, const WindowScores* scores) {
  const CompressionConfig& c = config_;
  const int cache_heads = c.CacheHeads(n_heads_, n_kv_heads_);
  if (layer < c.skip_layers || !c.Compresses(len)) {
    return std::vector<std::vector<int32_t>>(cache_heads, Range(0, len));
  }
  const int budget = c.EffectiveBudget(len);
  const int prefix = len - c.window;
  const int prefix_budget = budget - c.window;

  if (c.policy == Policy::kStreaming) {
    // sinks + the most recent budget - sinks tokens (the window is among them).
    std::vector<int32_t> kept = Range(0, c.sinks);
    for (int32_t j = len - (budget - c.sinks); j < len; ++j) kept.push_back(j);
    return std::vector<std::vector<int32_t>>(cache_heads, kept);
  }
  if (c.policy == Policy::kRandom) {
    std::vector<std::vector<int32_t>> kept;
    for (int h = 0; h < cache_heads; ++h) {
      const uint64_t seed = Mix(c.seed ^ Mix(static_cast<uint64_t>(layer) << 32 | h));
      kept.push_back(WithWindow(RandomSelect(prefix, prefix_budget, seed), prefix, len));
    }
    return kept;
  }
  if (c.policy == Policy::kChunkKV && !NeedsScoresFor(layer, len)) {
    // ChunkKV Algorithm 2: this layer reuses its group's first layer's indices.
    if (reuse_.empty()) return absl::FailedPreconditionError("chunkkv: reused layer before its anchor");
    return reuse_;
  }
  if (scores == nullptr || scores->data == nullptr || scores->len != len ||
      scores->window != c.window || scores->n_heads != n_heads_) {
    return absl::InternalError(absl::StrCat(PolicyName(c.policy), " needs window scores [", n_heads_,
                                            ", ", c.window, ", ", len, "]"));
  }
  std::vector<std::vector<float>> votes = HeadVotes(*scores, prefix);
  std::vector<std::vector<int32_t>> kept;
  switch (c.policy) {
    case Policy::kSnapKV:
    case Policy::kSnapKVpp: {
      // SnapKV++ always sums the group and picks its kernel by prompt length (Alg. 1).
      const bool pp = c.policy == Policy::kSnapKVpp;
      const GqaMode mode = pp ? GqaMode::kSum : c.gqa;
      const int kernel = !pp ? c.kernel : (len >= c.kernel_threshold ? c.kernel_large : c.kernel_small);
      const PoolKind pool = pp ? PoolKind::kMax : c.pool;
      for (const auto& row : GroupVotes(std::move(votes), mode, n_kv_heads_)) {
        kept.push_back(WithWindow(TopK(Pool(row, kernel, pool), prefix_budget), prefix, len));
      }
      return kept;
    }
    case Policy::kHBW: {
      const int block = c.block > 0 ? c.block : std::max(1, budget / 32);
      for (const auto& row : GroupVotes(std::move(votes), c.gqa, n_kv_heads_)) {
        kept.push_back(WithWindow(HbwSelect(row, block, c.groups, prefix_budget), prefix, len));
      }
      return kept;
    }
    case Policy::kChunkKV: {
      // One index set per layer, from the votes summed over every head.
      std::vector<float> tok(prefix, 0.f);
      for (const auto& row : votes) {
        for (int j = 0; j < prefix; ++j) tok[j] += row[j];
      }
      reuse_ = std::vector<std::vector<int32_t>>(
          cache_heads, WithWindow(ChunkSelect(tok, c.chunk, prefix_budget), prefix, len));
      return reuse_;
    }
    default:
      return absl::InternalError("unhandled policy");
  }
}

Compressor::Compressor(const CompressionConfig& config, const ModelConfig& model, DType kv_dtype,
                       CompressedLayerSink* sink)
    : config_(config),
      n_heads_(model.num_heads),
      n_kv_heads_(model.num_kv_heads),
      head_dim_(model.head_dim),
      kv_dtype_(kv_dtype),
      selector_(config, model.num_heads, model.num_kv_heads),
      sink_(sink) {}

// Only a prompt that will be compressed needs scores (their buffer is heads × w × L floats).
int Compressor::window(int len) const {
  return config_.NeedsScores() && config_.Compresses(len) ? config_.window : 0;
}

absl::Status Compressor::OnLayer(const PrefillLayer& layer) {
  const auto t0 = std::chrono::steady_clock::now();
  WindowScores ws{layer.window_scores, n_heads_, layer.window, layer.len};
  const bool need = selector_.NeedsScoresFor(layer.layer, layer.len);
  ASSIGN_OR_RETURN(auto kept, selector_.Select(layer.layer, layer.len, need ? &ws : nullptr));
  CompressedLayer out;
  out.layer = layer.layer;
  out.n_heads = static_cast<int>(kept.size());
  out.head_dim = head_dim_;
  out.count = kept.empty() ? 0 : static_cast<int>(kept[0].size());
  out.dtype = kv_dtype_;
  const size_t row = static_cast<size_t>(head_dim_) * DTypeSize(kv_dtype_);
  out.positions.reserve(static_cast<size_t>(out.n_heads) * out.count);
  out.k.resize(static_cast<size_t>(out.n_heads) * out.count * row);
  out.v.resize(out.k.size());
  const int heads_per_kv = out.n_heads / n_kv_heads_;
  for (int c = 0; c < out.n_heads; ++c) {
    const int g = c / heads_per_kv;
    for (int t = 0; t < out.count; ++t) {
      const int32_t pos = kept[c][t];
      out.positions.push_back(pos);
      const size_t dst = (static_cast<size_t>(c) * out.count + t) * row;
      FromFloat(kv_dtype_, layer.k + pos * layer.kv_stride + int64_t{g} * head_dim_, &out.k[dst],
                head_dim_);
      FromFloat(kv_dtype_, layer.v + pos * layer.kv_stride + int64_t{g} * head_dim_, &out.v[dst],
                head_dim_);
    }
  }
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink_->Accept(std::move(out));
}

KvCacheShape CompressedCacheShape(const CompressionConfig& config, const ModelConfig& model,
                                  DType kv_dtype, int len, int extra_tokens) {
  KvCacheShape shape;
  shape.n_heads = config.CacheHeads(model.num_heads, model.num_kv_heads);
  shape.head_dim = model.head_dim;
  shape.dtype = kv_dtype;
  for (int l = 0; l < model.num_layers; ++l) {
    shape.capacity.push_back(config.KeptTokens(l, len) + extra_tokens);
  }
  return shape;
}

absl::Status StoreLayer(const CompressedLayer& layer, KvCache* cache) {
  if (layer.layer < 0 || layer.layer >= cache->num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer.layer, " outside the cache's ",
                                                   cache->num_layers(), " layers"));
  }
  LayerCache& lc = cache->layer(layer.layer);
  if (layer.n_heads != lc.n_heads || layer.head_dim != lc.head_dim || layer.dtype != lc.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer.layer, " has ", layer.n_heads, " heads x ", layer.head_dim, " ",
        DTypeName(layer.dtype), " but the cache expects ", lc.n_heads, " x ", lc.head_dim, " ",
        DTypeName(lc.dtype)));
  }
  if (layer.count > lc.capacity) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer.layer, " has ", layer.count,
                                                   " tokens per head but the cache holds ",
                                                   lc.capacity));
  }
  const size_t row = lc.row_bytes();
  const size_t head_bytes = static_cast<size_t>(layer.count) * row;
  if (layer.k.size() != head_bytes * layer.n_heads || layer.v.size() != layer.k.size() ||
      layer.positions.size() != static_cast<size_t>(layer.count) * layer.n_heads) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer.layer, " payload sizes do not "
                                                   "match its shape"));
  }
  for (int c = 0; c < lc.n_heads; ++c) {
    std::memcpy(lc.k_row(c, 0), layer.k.data() + c * head_bytes, head_bytes);
    std::memcpy(lc.v_row(c, 0), layer.v.data() + c * head_bytes, head_bytes);
    std::memcpy(lc.positions + int64_t{c} * lc.capacity,
                layer.positions.data() + int64_t{c} * layer.count, layer.count * sizeof(int32_t));
  }
  lc.len = layer.count;
  return absl::OkStatus();
}

}  // namespace kvwire
