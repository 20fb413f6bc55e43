#include "common/sparse/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/base/kv_format.h"
#include "common/base/ranking.h"
#include "common/base/status.h"
#include "common/compression/compression.h"
#include "kernels/cpu/selection.h"

namespace kvwire {

const AttentionModeInfo& HybridModeInfo();     // rocketkv.cc
const AttentionModeInfo& QuestModeInfo();      // quest.cc
const AttentionModeInfo& ExactTopKModeInfo();  // exact_topk.cc

namespace {

const AttentionModeInfo& DenseInfo() {
  static const AttentionModeInfo* const info = new AttentionModeInfo{
      AttentionMode::kDense, "dense", "exact attention", {}, false, nullptr, nullptr, nullptr};
  return *info;
}

// The sparse selector of one sequence. Per layer and step Plan decides dense or sparse;
// then each cache head, on whichever thread the model gives it, brings its own page
// summaries up to date and lets the mode choose its tokens. Heads share nothing they write,
// so the parallel selection is the serial one.
// Memory of a backend as KvMemory, for page summaries kept where the cache's rows are.
class BackendMemory final : public KvMemory {
 public:
  BackendMemory(std::shared_ptr<kernels::KernelBackend> backend, void* data, size_t size)
      : backend_(std::move(backend)), data_(static_cast<uint8_t*>(data)), size_(size) {}
  ~BackendMemory() override { backend_->Free(data_); }
  uint8_t* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  std::shared_ptr<kernels::KernelBackend> backend_;
  uint8_t* data_;
  size_t size_;
};

class SparseSelector final : public DecodeSelector {
 public:
  // `memory` (summaries, scores, indices: SelectorMemory) is the host's, for the host path,
  // or a backend pool's, where the device path keeps its state (nothing allocated later).
  SparseSelector(SparseParams params, int dense_layers, const ModelConfig& model,
                 const KvCacheShape& shape, KvMemoryPtr summaries, KvMemoryPtr scratch)
      : p_(params),
        dense_layers_(dense_layers),
        info_(ModeInfo(params.mode)),
        n_heads_(model.num_heads),
        head_dim_(model.head_dim),
        shape_(shape) {
    kernels::KernelBackend* backend = scratch ? scratch->backend() : nullptr;
    if (backend == nullptr) {
      if (summaries) {
        summaries_ = std::make_unique<PageSummaries>(shape, p_.page_size, std::move(summaries),
                                                     dense_layers, info_.summary_tile_pages);
      }
      return;
    }
    // The device path's state, in the pool's pages.
    device_backend_ = backend;
    if (summaries) {
      device_sums_ = std::make_unique<PageSummaries>(shape, p_.page_size, std::move(summaries),
                                                     dense_layers, info_.summary_tile_pages);
      device_built_.assign(shape.capacity.size(), 0);
    }
    score_stride_ = ScoreStride(p_, shape);
    scores_ = reinterpret_cast<float*>(scratch->data());
    indices_ = reinterpret_cast<int32_t*>(scratch->data() + ScoresBytes(p_, shape));
    scratch_memory_ = std::move(scratch);
  }

  // The device path's scores (one per page, or per token for the exact oracle, of every cache
  // head) and indices, in one region.
  static int64_t ScoreStride(const SparseParams& p, const KvCacheShape& shape) {
    int capacity = 1;
    for (int cap : shape.capacity) capacity = std::max(capacity, cap);
    return p.mode == AttentionMode::kExactTopK ? capacity
                                               : (capacity + p.page_size - 1) / p.page_size;
  }
  static size_t ScoresBytes(const SparseParams& p, const KvCacheShape& shape) {
    return (sizeof(float) * static_cast<size_t>(shape.n_heads) * ScoreStride(p, shape) + 63) / 64 *
           64;
  }
  static size_t ScratchBytes(const SparseParams& p, const KvCacheShape& shape) {
    return ScoresBytes(p, shape) + sizeof(int32_t) * static_cast<size_t>(shape.n_heads) * p.top_k;
  }

  absl::StatusOr<bool> Plan(int layer, const LayerCache& lc, int* num) override {
    if (layer < dense_layers_) return false;  // kept whole by the compression: dense
    // The budget covers the cache: dense. Summaries catch up when the layer turns sparse
    // (an update recomputes every page from the first token not yet summarized).
    if (p_.top_k >= lc.len) return false;
    *num = p_.top_k;
    return true;
  }

  void SelectHead(int layer, const float* q, const LayerCache& lc, int c, int32_t* out) override {
    if (summaries_) summaries_->Update(layer, c, lc);
    const int group = n_heads_ / lc.n_heads;
    HeadQuery hq;
    hq.layer = layer;
    hq.head = c;
    hq.q = q + static_cast<int64_t>(c) * group * head_dim_;
    hq.group = group;
    hq.cache = &lc;
    hq.summaries = summaries_.get();
    hq.params = &p_;
    hq.out = out;
    info_.select(hq);
    // The attention kernel reads the chosen rows next (on a host backend, on this thread right
    // after: llama_model.cc). Short runs of rows scattered over the cache (pages of a few
    // tokens) it reads at a fraction of the streaming rate, waiting on each; asking for all of
    // them now overlaps those misses with one another. (Runs of many rows, Quest's pages, it
    // streams well enough: no need.)
    if (p_.page_size > kShortRun || lc.coded()) return;  // (a coded cache's rows are short)
    const size_t row = lc.row_bytes();
    for (int x = 0; x < p_.top_k; ++x) {
      const uint8_t* k = lc.k_row(c, out[x]);
      const uint8_t* v = lc.v_row(c, out[x]);
      for (size_t b = 0; b < row; b += 64) {
        __builtin_prefetch(k + b, 0, 2);
        __builtin_prefetch(v + b, 0, 2);
      }
    }
  }

 private:
  // The device path: the same selection as the backend's ops, over the device copy of the
  // cache, with summaries of its own in the backend's memory.
  bool SelectsOnBackend() const override { return true; }
  absl::Status PlanOnBackend(const std::shared_ptr<kernels::KernelBackend>& backend, int layer,
                             const LayerCache& lc, const float* q, BackendSelection* out) override {
    RETURN_IF_ERROR(ReserveOn(backend));
    const int group = n_heads_ / lc.n_heads;
    kernels::SummaryLayout layout;
    if (device_sums_) {
      layout = device_sums_->Layout(layer);
      int& built = device_built_[layer];
      if (built != lc.len) {
        kernels::SummaryUpdateSegment u;
        u.k = lc.k;
        u.kv = lc.layout;
        u.coding = lc.coding;
        u.n_heads = lc.n_heads;
        u.first = built;
        u.len = lc.len;
        u.summaries = const_cast<uint8_t*>(device_sums_->HeadBlock(layer, 0));
        u.layout = layout;
        out->updates.push_back(u);
        built = lc.len;
      }
    }
    const bool exact = p_.mode == AttentionMode::kExactTopK;
    for (int c = 0; c < lc.n_heads; ++c) {
      kernels::PageScoreSegment s;
      s.kind = exact                              ? kernels::PageScoreKind::kExact
               : p_.mode == AttentionMode::kQuest ? kernels::PageScoreKind::kQuest
                                                  : kernels::PageScoreKind::kHybrid;
      s.q = q + int64_t{c} * group * head_dim_;
      s.group = group;
      s.len = lc.len;
      if (device_sums_) {
        s.summaries = device_sums_->HeadBlock(layer, c);
        s.layout = layout;
      }
      s.top_r = p_.top_r;
      s.k = lc.k;
      s.kv = lc.layout;
      s.coding = lc.coding;
      s.head = c;
      s.scale = 1.f / std::sqrt(static_cast<float>(head_dim_));
      s.score = scores_ + int64_t{c} * score_stride_;
      out->scores.push_back(s);
      kernels::TopKSegment t;
      t.score = s.score;
      t.n = lc.len;
      t.run = exact ? 1 : p_.page_size;
      t.k = p_.top_k;
      t.out = indices_ + int64_t{c} * p_.top_k;
      out->top_k.push_back(t);
    }
    out->indices = indices_;
    return absl::OkStatus();
  }

 private:
  static constexpr int kShortRun = 8;  // tokens

  // The device path's state, made at its first step on a backend when the selector's memory
  // was the host's (a selector made outside a decode node's pool, in tests and tools).
  // The summaries' updates of the undone step never ran: rebuilt from the first token on at
  // the next plan of each layer (an update recomputes every page from `first`).
  void StepUndone() override { std::fill(device_built_.begin(), device_built_.end(), 0); }

  absl::Status ReserveOn(const std::shared_ptr<kernels::KernelBackend>& backend) {
    if (device_backend_ == backend.get()) return absl::OkStatus();
    if (device_backend_ != nullptr) {
      return absl::FailedPreconditionError(
          "a decode selector selects on one backend; this one already ran on another");
    }
    auto take = [&](size_t bytes) -> absl::StatusOr<KvMemoryPtr> {
      auto p = backend->Allocate(std::max<size_t>(bytes, 1));
      if (!p.ok()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "no backend memory for sparse attention's selection: ", p.status().message()));
      }
      return KvMemoryPtr(new BackendMemory(backend, *p, bytes));
    };
    score_stride_ = ScoreStride(p_, shape_);
    ASSIGN_OR_RETURN(scratch_memory_, take(ScratchBytes(p_, shape_)));
    scores_ = reinterpret_cast<float*>(scratch_memory_->data());
    indices_ = reinterpret_cast<int32_t*>(scratch_memory_->data() + ScoresBytes(p_, shape_));
    if (info_.summaries) {
      ASSIGN_OR_RETURN(KvMemoryPtr sums,
                       take(PageSummaries::Bytes(shape_, p_.page_size, dense_layers_)));
      device_sums_ = std::make_unique<PageSummaries>(shape_, p_.page_size, std::move(sums),
                                                     dense_layers_, info_.summary_tile_pages);
      device_built_.assign(shape_.capacity.size(), 0);
    }
    device_backend_ = backend.get();
    return absl::OkStatus();
  }

  SparseParams p_;
  int dense_layers_;
  const AttentionModeInfo& info_;
  int n_heads_, head_dim_;
  KvCacheShape shape_;
  std::unique_ptr<PageSummaries> summaries_;
  // The device path's.
  const kernels::KernelBackend* device_backend_ = nullptr;
  std::unique_ptr<PageSummaries> device_sums_;
  std::vector<int> device_built_;  // per layer: tokens the device summaries cover
  KvMemoryPtr scratch_memory_;
  float* scores_ = nullptr;
  int32_t* indices_ = nullptr;
  int64_t score_stride_ = 0;
};

// The parameters a sequence's selector will run with, sized by its sparse layers (the dense
// ones may hold the whole prompt).
absl::StatusOr<SparseParams> SelectorParams(const DecodeAttentionConfig& config,
                                            const ModelConfig& model, const KvCacheShape& cache) {
  int capacity = 0;
  for (size_t l = config.dense_layers; l < cache.capacity.size(); ++l) {
    capacity = std::max(capacity, cache.capacity[l]);
  }
  return ResolveSparseParams(config, capacity, model.head_dim);
}

}  // namespace

const std::vector<const AttentionModeInfo*>& AttentionModes() {
  static const auto* const kModes = new std::vector<const AttentionModeInfo*>{
      &DenseInfo(), &HybridModeInfo(), &QuestModeInfo(), &ExactTopKModeInfo()};
  return *kModes;
}

const AttentionModeInfo& ModeInfo(AttentionMode mode) {
  for (const AttentionModeInfo* m : AttentionModes()) {
    if (m->mode == mode) return *m;
  }
  KVWIRE_CHECK(false);  // every enumerator is registered
  return DenseInfo();
}

absl::string_view AttentionModeName(AttentionMode m) { return ModeInfo(m).name; }

absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name) {
  std::vector<std::string> names;
  for (const AttentionModeInfo* m : AttentionModes()) {
    if (name == m->name) return m->mode;
    names.push_back(m->name);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown decode attention mode '", name, "'; expected one of ", absl::StrJoin(names, ", ")));
}

absl::Status DecodeAttentionConfig::Validate() const {
  // Each error is about the request field it names (attention.<param>), for google.rpc.BadRequest.
  const auto bad = [](absl::string_view param, absl::string_view what) {
    return AboutField(absl::InvalidArgumentError(absl::StrCat("attention: ", param, " ", what)),
                      absl::StrCat("attention.", param));
  };
  struct Param {
    const char* name;
    int value;
    int max;
  };
  const Param params[] = {{"token_budget", token_budget, kMaxTokenBudget},
                          {"top_k", top_k, kMaxTokenBudget},
                          {"top_r", top_r, 1 << 16},
                          {"page_size", page_size, 1 << 16},
                          {"dense_layers", dense_layers, std::numeric_limits<int>::max()}};
  for (const Param& p : params) {
    if (p.value < 0) return bad(p.name, absl::StrCat("must be >= 0, got ", p.value));
    if (p.value > p.max) return bad(p.name, absl::StrCat("must be <= ", p.max, ", got ", p.value));
  }
  const AttentionModeInfo& info = ModeInfo(mode);
  for (const Param& p : params) {
    if (p.value == 0 || absl::string_view(p.name) == "dense_layers") continue;
    if (std::find_if(info.params.begin(), info.params.end(), [&](const char* q) {
          return absl::string_view(q) == p.name;
        }) == info.params.end()) {
      return bad(p.name,
                 absl::StrCat("does not apply to ", info.name, " (",
                              info.params.empty()
                                  ? std::string("it takes no parameters")
                                  : absl::StrCat("it takes ", absl::StrJoin(info.params, ", ")),
                              ")"));
    }
  }
  if (mode != AttentionMode::kDense && token_budget == 0 && top_k == 0) {
    return bad("token_budget", absl::StrCat("is needed by ", info.name, " (or an explicit top_k)"));
  }
  if (mode != AttentionMode::kDense && token_budget == 1 && top_k == 0) {
    return bad("token_budget", "must be at least 2 (k = t/2)");
  }
  return absl::OkStatus();
}

std::string DecodeAttentionConfig::Describe() const {
  if (mode == AttentionMode::kDense) return "dense";
  std::vector<std::string> parts;
  if (token_budget) parts.push_back(absl::StrCat("t=", token_budget));
  if (top_k) parts.push_back(absl::StrCat("k=", top_k));
  if (top_r) parts.push_back(absl::StrCat("r=", top_r));
  if (page_size) parts.push_back(absl::StrCat("page=", page_size));
  if (dense_layers) parts.push_back(absl::StrCat("dense_layers=", dense_layers));
  return absl::StrCat(AttentionModeName(mode), "(", absl::StrJoin(parts, ", "), ")");
}

absl::StatusOr<SparseParams> ResolveSparseParams(const DecodeAttentionConfig& c, int capacity,
                                                 int head_dim) {
  RETURN_IF_ERROR(c.Validate());
  SparseParams p;
  p.mode = c.mode;
  if (c.mode == AttentionMode::kDense) return p;
  ASSIGN_OR_RETURN(p, ModeInfo(c.mode).resolve(c, std::max(1, capacity), head_dim));
  // Explicit parameters override what the budget derives.
  if (c.top_k > 0) p.top_k = c.top_k;
  if (c.top_r > 0) p.top_r = std::min(head_dim, c.top_r);
  if (c.page_size > 0) p.page_size = c.page_size;
  if (p.top_k < 1) return absl::InvalidArgumentError("attention: top_k resolved to 0");
  if (const auto finish = ModeInfo(c.mode).finish) finish(&p);
  return p;
}

int64_t BytesReadPerStep(const SparseParams& p, int len, int head_dim, DType dtype) {
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t row = int64_t{head_dim} * es;
  if (p.mode == AttentionMode::kDense || p.top_k >= len) return 2 * row * len;
  return ModeInfo(p.mode).bytes_read(p, len, row, es);
}

int64_t BytesReadPerStep(const SparseParams& p, const LayerCache& l) {
  if (!l.coded()) return BytesReadPerStep(p, l.len, l.head_dim, l.dtype);
  if (p.mode == AttentionMode::kDense || p.top_k >= l.len) return l.HeadBytes();
  const int64_t row = static_cast<int64_t>(l.row_bytes());
  const KvFormat f = l.coding.format;
  const int64_t key_row = static_cast<int64_t>(KvKeyCodeBytes(f, l.dtype, l.head_dim));
  const int64_t value_row = static_cast<int64_t>(KvValueRowBytes(f, l.dtype, l.head_dim));
  const int64_t group_bytes =
      static_cast<int64_t>(KvKeyGroupBytes(f, l.head_dim)) + (f == KvFormat::kFP8 ? 1 : 0);
  const int coded = l.coding.ResidBegin(l.len);
  const int64_t groups = coded > 0 ? KvGroups{l.coding.kept}.Of(coded - 1) + 1 : 0;
  const int64_t resid = std::min<int64_t>(p.top_k, l.len - coded);  // chosen residual rows
  if (p.mode == AttentionMode::kExactTopK) {  // every key scored, the chosen rows' values read
    return coded * key_row + groups * group_bytes + (l.len - coded) * row +
           (p.top_k - resid) * value_row + resid * row;
  }
  const int64_t beside_rows = BytesReadPerStep(p, l.len, l.head_dim, l.dtype) - 2 * row * p.top_k;
  return beside_rows + resid * 2 * row + (p.top_k - resid) * (key_row + value_row) +
         std::min(p.top_k - resid, groups) * group_bytes;
}

absl::StatusOr<size_t> DecodeSelectorBytes(const DecodeAttentionConfig& config,
                                           const ModelConfig& model, const KvCacheShape& cache) {
  if (config.mode == AttentionMode::kDense) return size_t{0};
  ASSIGN_OR_RETURN(SparseParams p, SelectorParams(config, model, cache));
  const size_t summaries = ModeInfo(p.mode).summaries
                               ? PageSummaries::Bytes(cache, p.page_size, config.dense_layers)
                               : 0;
  return summaries + SparseSelector::ScratchBytes(p, cache);
}

absl::StatusOr<std::unique_ptr<DecodeSelector>> MakeDecodeSelector(
    const DecodeAttentionConfig& config, const ModelConfig& model, const KvCacheShape& cache,
    KvAllocator& allocator) {
  if (config.mode == AttentionMode::kDense) return std::unique_ptr<DecodeSelector>();
  ASSIGN_OR_RETURN(SparseParams p, SelectorParams(config, model, cache));
  KvMemoryPtr summaries;
  if (ModeInfo(p.mode).summaries) {
    ASSIGN_OR_RETURN(summaries, allocator.Allocate(
                                    PageSummaries::Bytes(cache, p.page_size, config.dense_layers)));
  }
  ASSIGN_OR_RETURN(KvMemoryPtr scratch, allocator.Allocate(SparseSelector::ScratchBytes(p, cache)));
  return std::unique_ptr<DecodeSelector>(new SparseSelector(
      p, config.dense_layers, model, cache, std::move(summaries), std::move(scratch)));
}

void TakePages(const std::vector<float>& score, int page, int len, int k, int32_t* out) {
  kernels::cpu::TakeBest(score.data(), page, len, k, /*ascending=*/false, out);
}

void DefineAttentionFlags(Flags& flags) {
  std::vector<std::string> names;
  for (const AttentionModeInfo* m : AttentionModes()) names.push_back(m->name);
  flags.Define("attention", "dense", "decode attention: " + absl::StrJoin(names, ", "));
  flags.Define("attention-budget", "0",
               "per-step token budget of sparse attention, per KV head, auxiliary reads included");
  flags.Define("attention-k", "0", "tokens attended per KV head (overrides the budget's)");
  flags.Define("attention-r", "0", "hybrid: head dimensions approximated (overrides)");
  flags.Define("attention-page", "0", "hybrid, quest: tokens per page summary (overrides)");
}

absl::StatusOr<DecodeAttentionConfig> AttentionFromFlags(const Flags& flags) {
  DecodeAttentionConfig a;
  ASSIGN_OR_RETURN(a.mode, ParseAttentionMode(flags.GetString("attention")));
  ASSIGN_OR_RETURN(int64_t t, flags.GetInt("attention-budget", 0, 1 << 30));
  ASSIGN_OR_RETURN(int64_t k, flags.GetInt("attention-k", 0, 1 << 30));
  ASSIGN_OR_RETURN(int64_t r, flags.GetInt("attention-r", 0, 1 << 20));
  ASSIGN_OR_RETURN(int64_t p, flags.GetInt("attention-page", 0, 1 << 20));
  a.token_budget = static_cast<int>(t);
  a.top_k = static_cast<int>(k);
  a.top_r = static_cast<int>(r);
  a.page_size = static_cast<int>(p);
  if (absl::Status st = a.Validate(); !st.ok()) {
    // Name the flags, not the fields.
    std::string m(st.message());
    for (const auto& [field, flag] :
         {std::pair<const char*, const char*>{"token_budget", "--attention-budget"},
          {"top_k", "--attention-k"},
          {"top_r", "--attention-r"},
          {"page_size", "--attention-page"}}) {
      m = absl::StrReplaceAll(m, {{absl::StrCat("attention: ", field), flag},
                                  {absl::StrCat(" ", field, ","), absl::StrCat(" ", flag, ",")},
                                  {absl::StrCat(" ", field, ")"), absl::StrCat(" ", flag, ")")}});
    }
    return absl::Status(st.code(), m);
  }
  return a;
}

}  // namespace kvwire
