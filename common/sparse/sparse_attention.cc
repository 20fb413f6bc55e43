#include "common/sparse/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "kernels/simd.h"

namespace kvwire {
namespace {

// Loads n elements of `dtype` as floats.
void Widen(const uint8_t* src, DType dtype, float* dst, int n) { ToFloat(dtype, src, dst, n); }

// Takes whole pages in rank order until k slots are collected, cutting the last page to
// its lowest slots (docs §3.3: all slots of a page share its score, so top-k tokens are
// whole pages plus part of one; the cut is deterministic rather than tie-order).
void TakePages(const std::vector<float>& score, int page, int len, int k, int32_t* out) {
  const int n_pages = static_cast<int>(score.size());
  auto better = [&](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::vector<int32_t> order(n_pages);
  std::iota(order.begin(), order.end(), 0);
  // Only the best pages are needed: ceil(k/page) of them, one more for a short last page.
  int sorted = std::min(n_pages, (k + page - 1) / page + 1);
  std::partial_sort(order.begin(), order.begin() + sorted, order.end(), better);
  int n = 0;
  for (int i = 0; i < n_pages && n < k; ++i) {
    if (i == sorted) {  // more short pages than expected: rank the rest too
      std::sort(order.begin() + sorted, order.end(), better);
      sorted = n_pages;
    }
    const int p = order[i];
    for (int t = p * page; t < std::min(len, (p + 1) * page) && n < k; ++t) out[n++] = t;
  }
}

class SparseSelector final : public DecodeSelector {
 public:
  SparseSelector(SparseParams params, const ModelConfig& model, const KvCacheShape& shape,
                 std::unique_ptr<PageSummaries> summaries)
      : p_(params),
        n_heads_(model.num_heads),
        head_dim_(model.head_dim),
        summaries_(std::move(summaries)) {
    (void)shape;
  }

  absl::StatusOr<bool> Select(int layer, const float* q, LayerCache& lc,
                              std::vector<int32_t>* indices, int* num) override {
    if (summaries_) summaries_->Update(layer, lc);
    if (p_.top_k >= lc.len) return false;  // the budget covers the cache: dense
    const int k = p_.top_k;
    const int group = n_heads_ / lc.n_heads;
    indices->resize(static_cast<size_t>(lc.n_heads) * k);
    *num = k;
    for (int c = 0; c < lc.n_heads; ++c) {
      const float* qg = q + static_cast<int64_t>(c) * group * head_dim_;
      int32_t* out = indices->data() + static_cast<size_t>(c) * k;
      switch (p_.mode) {
        case AttentionMode::kHybrid:
          HybridHead(layer, c, qg, group, lc, out);
          break;
        case AttentionMode::kQuest:
          QuestHead(layer, c, qg, group, lc, out);
          break;
        case AttentionMode::kExactTopK:
          ExactHead(c, qg, group, lc, out);
          break;
        case AttentionMode::kDense:
          return false;
      }
    }
    return true;
  }

 private:
  // RocketKV Algorithm 2 for one KV head and its `group` query heads.
  void HybridHead(int layer, int c, const float* q, int group, const LayerCache& lc, int32_t* out) {
    const int d = head_dim_, r = std::min(p_.top_r, d);
    const int n_pages = summaries_->pages(lc.len);
    // Line 3: the r dimensions with the largest Σ_g |q_g| (ties to the lower index).
    std::vector<float> a(d, 0.f), sum(d, 0.f);
    for (int g = 0; g < group; ++g) {
      for (int i = 0; i < d; ++i) {
        a[i] += std::fabs(q[g * d + i]);
        sum[i] += q[g * d + i];
      }
    }
    std::vector<int32_t> dims(d);
    std::iota(dims.begin(), dims.end(), 0);
    std::partial_sort(dims.begin(), dims.begin() + r, dims.end(), [&](int32_t x, int32_t y) {
      return a[x] > a[y] || (a[x] == a[y] && x < y);
    });
    // Lines 4-6: per dimension K_max where Σ_g q ≥ 0 else K_min; per-head page logits.
    // Each summary row is read once, in the cache dtype, straight into every head's AXPY.
    std::vector<float> u(static_cast<size_t>(group) * n_pages, 0.f);
    for (int x = 0; x < r; ++x) {
      const int i = dims[x];
      const uint8_t* row = summaries_->Row(layer, c, sum[i] >= 0.f, i);
      for (int g = 0; g < group; ++g) {
        kernels::simd::Axpy(q[g * d + i], row, lc.dtype, u.data() + static_cast<size_t>(g) * n_pages,
                            n_pages);
      }
    }
    // SparQ-style temperature: each head's scale sqrt(d · ||q_I||_1 / ||q||_1); a softmax
    // per head over slots (each slot carries its page's logit), then the group's sum.
    const int page = summaries_->page();
    const int last_page_slots = lc.len - (n_pages - 1) * page;
    std::vector<float> score(n_pages, 0.f);
    for (int g = 0; g < group; ++g) {
      const float* qh = q + g * d;
      float num = 0.f, den = 0.f;
      for (int x = 0; x < r; ++x) num += std::fabs(qh[dims[x]]);
      for (int i = 0; i < d; ++i) den += std::fabs(qh[i]);
      const float inv_scale = den > 0.f && num > 0.f ? 1.f / std::sqrt(d * num / den) : 1.f;
      float* ug = u.data() + static_cast<size_t>(g) * n_pages;
      float mx = -std::numeric_limits<float>::infinity();
      for (int p = 0; p < n_pages; ++p) {
        ug[p] *= inv_scale;
        mx = std::max(mx, ug[p]);
      }
      // Every page but the last holds `page` slots, each carrying the page's logit.
      const float total = kernels::simd::ExpShiftSum(ug, n_pages, mx);  // ug now holds exps
      const float z = total * page - ug[n_pages - 1] * static_cast<float>(page - last_page_slots);
      kernels::simd::Axpy(1.f / z, ug, DType::kF32, score.data(), n_pages);
    }
    TakePages(score, summaries_->page(), lc.len, p_.top_k, out);  // line 7
  }

  // Quest's bound per page, Σ_i max(q_i·K_max, q_i·K_min), summed over the group.
  void QuestHead(int layer, int c, const float* q, int group, const LayerCache& lc, int32_t* out) {
    const int d = head_dim_;
    const int n_pages = summaries_->pages(lc.len);
    std::vector<float> bound(n_pages, 0.f);
    for (int i = 0; i < d; ++i) {
      const uint8_t* hi = summaries_->Row(layer, c, true, i);
      const uint8_t* lo = summaries_->Row(layer, c, false, i);
      for (int g = 0; g < group; ++g) {
        const float qi = q[g * d + i];
        kernels::simd::Axpy(qi, qi >= 0.f ? hi : lo, lc.dtype, bound.data(), n_pages);
      }
    }
    TakePages(bound, summaries_->page(), lc.len, p_.top_k, out);
  }

  // The oracle: exact softmax scores per head, summed over the group, top-k tokens.
  void ExactHead(int c, const float* q, int group, const LayerCache& lc, int32_t* out) {
    const int d = head_dim_;
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    std::vector<float> total(lc.len, 0.f), s(lc.len), row(d);
    for (int g = 0; g < group; ++g) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < lc.len; ++t) {
        Widen(lc.k_row(c, t), lc.dtype, row.data(), d);
        float dot = 0.f;
        for (int i = 0; i < d; ++i) dot += q[g * d + i] * row[i];
        s[t] = dot * scale;
        mx = std::max(mx, s[t]);
      }
      double z = 0;
      for (int t = 0; t < lc.len; ++t) z += s[t] = std::exp(s[t] - mx);
      for (int t = 0; t < lc.len; ++t) total[t] += static_cast<float>(s[t] / z);
    }
    TakePages(total, 1, lc.len, p_.top_k, out);
  }

  SparseParams p_;
  int n_heads_, head_dim_;
  std::unique_ptr<PageSummaries> summaries_;
};

}  // namespace

PageSummaries::PageSummaries(const KvCacheShape& shape, int page, KvMemoryPtr memory)
    : shape_(shape), page_(page), memory_(std::move(memory)), built_(shape.capacity.size(), 0) {
  for (int c : shape.capacity) max_pages_.push_back((c + page - 1) / page);
  size_t off = 0;
  for (size_t l = 0; l < shape.capacity.size(); ++l) {
    offsets_.push_back(off);
    off += static_cast<size_t>(shape_.n_heads) * 2 * shape_.head_dim * max_pages_[l] *
           DTypeSize(shape_.dtype);
  }
}

size_t PageSummaries::Bytes(const KvCacheShape& shape, int page) {
  size_t total = 0;
  for (int c : shape.capacity) {
    total += static_cast<size_t>(shape.n_heads) * 2 * shape.head_dim * ((c + page - 1) / page) *
             DTypeSize(shape.dtype);
  }
  return total;
}

uint8_t* PageSummaries::Row(int layer, int head, bool max, int dim) {
  const size_t row = static_cast<size_t>(max_pages_[layer]) * DTypeSize(shape_.dtype);
  return memory_->data() + offsets_[layer] +
         ((static_cast<size_t>(head) * 2 + (max ? 1 : 0)) * shape_.head_dim + dim) * row;
}

float PageSummaries::Value(int layer, int head, bool max, int dim, int page) {
  float v;
  ToFloat(shape_.dtype, Row(layer, head, max, dim) + page * DTypeSize(shape_.dtype), &v, 1);
  return v;
}

// The page holding the first token not yet summarized is recomputed from its slots, and
// so is every later one: appending touches only the last page.
void PageSummaries::Update(int layer, const LayerCache& lc) {
  const int d = shape_.head_dim;
  const int first = built_[layer] / page_;
  const int last = pages(lc.len);
  std::vector<float> lo(d), hi(d), row(d);
  const size_t es = DTypeSize(shape_.dtype);
  for (int h = 0; h < lc.n_heads; ++h) {
    for (int p = first; p < last; ++p) {
      std::fill(lo.begin(), lo.end(), std::numeric_limits<float>::infinity());
      std::fill(hi.begin(), hi.end(), -std::numeric_limits<float>::infinity());
      for (int t = p * page_; t < std::min(lc.len, (p + 1) * page_); ++t) {
        Widen(lc.k_row(h, t), lc.dtype, row.data(), d);
        for (int i = 0; i < d; ++i) {
          lo[i] = std::min(lo[i], row[i]);
          hi[i] = std::max(hi[i], row[i]);
        }
      }
      // Min and max of values in the cache dtype are exact in it: they are stored so.
      for (int i = 0; i < d; ++i) {
        FromFloat(lc.dtype, &lo[i], Row(layer, h, false, i) + p * es, 1);
        FromFloat(lc.dtype, &hi[i], Row(layer, h, true, i) + p * es, 1);
      }
    }
  }
  built_[layer] = lc.len;
}

absl::string_view AttentionModeName(AttentionMode m) {
  switch (m) {
    case AttentionMode::kDense:
      return "dense";
    case AttentionMode::kHybrid:
      return "hybrid";
    case AttentionMode::kQuest:
      return "quest";
    case AttentionMode::kExactTopK:
      return "exact_topk";
  }
  return "?";
}

absl::StatusOr<AttentionMode> ParseAttentionMode(absl::string_view name) {
  for (AttentionMode m : {AttentionMode::kDense, AttentionMode::kHybrid, AttentionMode::kQuest,
                          AttentionMode::kExactTopK}) {
    if (name == AttentionModeName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown decode attention mode '", name, "'; expected dense, hybrid, quest or exact_topk"));
}

absl::Status DecodeAttentionConfig::Validate() const {
  if (token_budget < 0 || top_k < 0 || top_r < 0 || page_size < 0) {
    return absl::InvalidArgumentError(
        "attention: token_budget, top_k, top_r and page_size must be >= 0");
  }
  if (token_budget > (1 << 26) || top_k > (1 << 26) || top_r > (1 << 16) || page_size > (1 << 16)) {
    return absl::InvalidArgumentError(
        "attention: token_budget and top_k must be <= 2^26, top_r and page_size <= 2^16");
  }
  if (mode != AttentionMode::kDense && token_budget == 0 && top_k == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: ", AttentionModeName(mode), " needs a token_budget (or an explicit top_k)"));
  }
  if (mode != AttentionMode::kDense && token_budget == 1 && top_k == 0) {
    return absl::InvalidArgumentError("attention: token_budget must be at least 2 (k = t/2)");
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
  return absl::StrCat(AttentionModeName(mode), "(", absl::StrJoin(parts, ", "), ")");
}

absl::StatusOr<SparseParams> ResolveSparseParams(const DecodeAttentionConfig& c, int capacity,
                                                 int head_dim) {
  RETURN_IF_ERROR(c.Validate());
  SparseParams p;
  p.mode = c.mode;
  if (c.mode == AttentionMode::kDense) return p;
  const double n = std::max(1, capacity);
  const int t = c.token_budget;
  switch (c.mode) {
    case AttentionMode::kHybrid: {
      // Half the budget to the sparse attention, half to the approximation; page size and
      // r split the stage-2 ratio c2 = capacity / t (authors' code, docs §3.4).
      const double c2 = t > 0 ? std::max(1.0, n / t) : 1.0;
      p.page_size = std::max(1, std::min(static_cast<int>(std::floor(c2)),
                                         static_cast<int>(std::ceil(std::sqrt(c2)))));
      p.top_r = std::min(head_dim, std::max(1, static_cast<int>(std::lround(head_dim * p.page_size / c2))));
      p.top_k = t > 0 ? std::max(1, static_cast<int>(std::lround(t / 2.0))) : 0;
      break;
    }
    case AttentionMode::kQuest:
      // Reading both summaries of a page is one token-equivalent: pages = t/2 → P = 2n/t.
      p.page_size = t > 0 ? std::max(1, static_cast<int>(std::ceil(2 * n / t))) : 16;
      p.top_r = head_dim;
      p.top_k = t > 0 ? std::max(1, t / 2) : 0;
      break;
    case AttentionMode::kExactTopK:
      p.top_r = head_dim;
      p.top_k = t;
      break;
    default:
      break;
  }
  if (c.top_k > 0) p.top_k = c.top_k;
  if (c.top_r > 0) p.top_r = std::min(head_dim, c.top_r);
  if (c.page_size > 0) p.page_size = c.page_size;
  if (p.top_k < 1) return absl::InvalidArgumentError("attention: top_k resolved to 0");
  return p;
}

int64_t BytesReadPerStep(const SparseParams& p, int len, int head_dim, DType dtype) {
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t row = int64_t{head_dim} * es;
  const int64_t k = std::min(p.top_k, len);
  const int64_t pages = (len + p.page_size - 1) / p.page_size;
  switch (p.mode) {
    case AttentionMode::kDense:
      return 2 * row * len;
    case AttentionMode::kHybrid:
      return p.top_k >= len ? 2 * row * len : 2 * row * k + pages * p.top_r * es;
    case AttentionMode::kQuest:
      return p.top_k >= len ? 2 * row * len : 2 * row * k + pages * 2 * row;
    case AttentionMode::kExactTopK:
      return p.top_k >= len ? 2 * row * len : row * len + row * k;
  }
  return 0;
}

absl::StatusOr<TwoStage> ResolveRocketKV(int token_budget, int prompt_len, int max_new,
                                         int head_dim, const CompressionConfig& base) {
  if (token_budget < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("rocketkv needs a token budget of at least 2, got ", token_budget));
  }
  const double s = prompt_len + max_new;
  const double t = std::min<double>(s, token_budget);
  const double c = std::max(1.0, s / t);
  const double alpha = std::min(0.2 + 0.06 * std::log2(c), 0.8);
  const int capacity = static_cast<int>(s / std::pow(c, alpha));
  TwoStage out;
  out.stage1 = base;
  out.stage1.policy = Policy::kSnapKVpp;
  out.stage1.ratio = 0;
  // The code's prompt_budget = min(S - max_new, capacity - max_new); when max_new eats the
  // whole capacity it would leave nothing, so stage 1 keeps at least the window and one.
  out.stage1.budget = std::max(base.window + 1, std::min(prompt_len, capacity - max_new));
  out.stage2.mode = AttentionMode::kHybrid;
  out.stage2.token_budget = token_budget;
  const double c2 = std::max(1.0, capacity / t);
  out.stage2.page_size = std::max(1, std::min(static_cast<int>(std::floor(c2)),
                                              static_cast<int>(std::ceil(std::sqrt(c2)))));
  out.stage2.top_r = std::min(head_dim, std::max(1, static_cast<int>(std::lround(
                                                        head_dim * out.stage2.page_size / c2))));
  out.stage2.top_k = std::max(1, std::min(static_cast<int>(std::lround(t / 2)), capacity));
  return out;
}

absl::Status ResolveTwoStage(CompressionConfig* compression, DecodeAttentionConfig* attention,
                             int prompt_len, int max_new, int head_dim) {
  if (compression->policy != Policy::kRocketKV) return absl::OkStatus();
  ASSIGN_OR_RETURN(TwoStage two, ResolveRocketKV(compression->budget, prompt_len, max_new,
                                                 head_dim, *compression));
  *compression = two.stage1;
  *attention = two.stage2;
  return absl::OkStatus();
}

namespace {

// The parameters a sequence's selector will run with, and whether it keeps page summaries.
absl::StatusOr<SparseParams> SelectorParams(const DecodeAttentionConfig& config,
                                            const ModelConfig& model, const KvCacheShape& cache) {
  int capacity = 0;
  for (int c : cache.capacity) capacity = std::max(capacity, c);
  return ResolveSparseParams(config, capacity, model.head_dim);
}

bool KeepsSummaries(const SparseParams& p) {
  return p.mode == AttentionMode::kHybrid || p.mode == AttentionMode::kQuest;
}

}  // namespace

absl::StatusOr<size_t> DecodeSelectorBytes(const DecodeAttentionConfig& config,
                                           const ModelConfig& model, const KvCacheShape& cache) {
  if (config.mode == AttentionMode::kDense) return size_t{0};
  ASSIGN_OR_RETURN(SparseParams p, SelectorParams(config, model, cache));
  return KeepsSummaries(p) ? PageSummaries::Bytes(cache, p.page_size) : size_t{0};
}

absl::StatusOr<std::unique_ptr<DecodeSelector>> MakeDecodeSelector(const DecodeAttentionConfig& config,
                                                                   const ModelConfig& model,
                                                                   const KvCacheShape& cache,
                                                                   KvAllocator& allocator) {
  if (config.mode == AttentionMode::kDense) return std::unique_ptr<DecodeSelector>();
  ASSIGN_OR_RETURN(SparseParams p, SelectorParams(config, model, cache));
  std::unique_ptr<PageSummaries> summaries;
  if (KeepsSummaries(p)) {
    ASSIGN_OR_RETURN(KvMemoryPtr mem, allocator.Allocate(PageSummaries::Bytes(cache, p.page_size)));
    summaries = std::make_unique<PageSummaries>(cache, p.page_size, std::move(mem));
  }
  return std::unique_ptr<DecodeSelector>(new SparseSelector(p, model, cache, std::move(summaries)));
}

}  // namespace kvwire
