// The reference selection ops (kernels/selection.h): the specification, in plain loops over
// float32 (double where the host's sampling and exact scores sum in double), one item after
// another. The CPU backend's versions (kernels/cpu/) and the CUDA kernels are tested against
// these.
#include "kernels/reference_selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/base/ranking.h"
#include "kernels/coded_rows.h"

namespace kvwire::kernels::reference {
namespace {

float Load(const void* base, DType dtype, int64_t i) {
  float v;
  ToFloat(dtype, static_cast<const uint8_t*>(base) + i * static_cast<int64_t>(DTypeSize(dtype)), &v,
          1);
  return v;
}

void Store(void* base, DType dtype, int64_t i, float v) {
  FromFloat(dtype, &v, static_cast<uint8_t*>(base) + i * static_cast<int64_t>(DTypeSize(dtype)), 1);
}

}  // namespace

void WindowVotes(const WindowVotesParams& p) {
  const int rows = p.n_heads / p.group;
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < p.prefix; ++j) {
      float acc = p.reduce == VoteReduce::kMax ? -std::numeric_limits<float>::infinity() : 0.f;
      for (int x = 0; x < p.group; ++x) {
        const int h = r * p.group + x;
        float vote = 0.f;
        for (int i = 0; i < p.window; ++i)
          vote += p.scores[(int64_t{h} * p.window + i) * p.len + j];
        acc = p.reduce == VoteReduce::kMax ? std::max(acc, vote) : acc + vote;
      }
      p.votes[int64_t{r} * p.prefix + j] = p.reduce == VoteReduce::kMean ? acc / p.group : acc;
    }
  }
}

void Pool1d(const Pool1dParams& p) {
  const int half = p.kernel / 2;
  for (int r = 0; r < p.rows; ++r) {
    const float* x = p.x + int64_t{r} * p.n;
    float* y = p.y + int64_t{r} * p.n;
    for (int j = 0; j < p.n; ++j) {
      if (p.kernel == 1) {
        y[j] = x[j];
        continue;
      }
      const int lo = std::max(0, j - half), hi = std::min(p.n - 1, j + half);
      if (p.kind == PoolKind::kMax) {
        float m = -std::numeric_limits<float>::infinity();
        for (int i = lo; i <= hi; ++i) m = std::max(m, x[i]);
        y[j] = m;
      } else {
        float s = 0.f;
        for (int i = lo; i <= hi; ++i) s += x[i];
        y[j] = s / static_cast<float>(p.kernel);
      }
    }
  }
}

void RunMeans(const RunMeansParams& p) {
  const int runs = (p.n + p.run - 1) / p.run;
  for (int r = 0; r < p.rows; ++r) {
    for (int m = 0; m < runs; ++m) {
      const int lo = m * p.run, hi = std::min(p.n, lo + p.run);
      float s = 0.f;
      for (int j = lo; j < hi; ++j) s += p.x[int64_t{r} * p.n + j];
      p.y[int64_t{r} * runs + m] = s / static_cast<float>(hi - lo);
    }
  }
}

void TopK(const TopKParams& p) {
  for (int i = 0; i < p.count; ++i) {
    const TopKSegment& s = p.segs[i];
    std::vector<int32_t> order(s.n);
    std::iota(order.begin(), order.end(), 0);
    // The whole order, by the ranking rule spelled out: score, then tie, then index.
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      const float sa = s.score[a / s.run], sb = s.score[b / s.run];
      if (ScoreBefore(sa, sb)) return true;
      if (ScoreBefore(sb, sa)) return false;
      if (s.tie != nullptr) {
        if (ScoreBefore(s.tie[a], s.tie[b])) return true;
        if (ScoreBefore(s.tie[b], s.tie[a])) return false;
      }
      return a < b;
    });
    order.resize(s.k);
    if (p.ascending) std::sort(order.begin(), order.end());
    for (int j = 0; j < s.append; ++j) order.push_back(s.n + j);
    std::copy(order.begin(), order.end(), s.out);
  }
}

void HbwSelect(const HbwSelectParams& p) {
  const int n_blocks = (p.prefix + p.block - 1) / p.block;
  auto block_size = [&](int b) { return std::min(p.prefix, (b + 1) * p.block) - b * p.block; };
  for (int row = 0; row < p.rows; ++row) {
    const float* score = p.block_scores + int64_t{row} * n_blocks;
    std::vector<int32_t> rank(n_blocks);
    std::iota(rank.begin(), rank.end(), 0);
    std::sort(rank.begin(), rank.end(), [&](int32_t a, int32_t b) {
      if (ScoreBefore(score[a], score[b])) return true;
      if (ScoreBefore(score[b], score[a])) return false;
      return a < b;
    });
    std::vector<int> rank_of(n_blocks);
    for (int r = 0; r < n_blocks; ++r) rank_of[rank[r]] = r;
    std::vector<bool> selected(n_blocks, false);
    int used = 0;
    const int whole = p.prefix_budget / p.block;
    for (int r = 0; r < p.n_rounds; ++r) {
      const int round_blocks = whole / p.n_rounds + (r < whole % p.n_rounds ? 1 : 0);
      const int m_groups = std::min(p.rounds[r], n_blocks);
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
          if (taken == quota || used + block_size(b) > p.prefix_budget) break;
          selected[b] = true;
          ++taken;
          used += block_size(b);
        }
      }
    }
    // The fill: the best remaining blocks, the last one cut to fit.
    int partial_block = -1, partial_len = 0;
    for (int32_t b : rank) {
      if (used >= p.prefix_budget) break;
      if (selected[b]) continue;
      if (used + block_size(b) <= p.prefix_budget) {
        selected[b] = true;
        used += block_size(b);
      } else {
        partial_block = b;
        partial_len = p.prefix_budget - used;
        used = p.prefix_budget;
      }
    }
    int32_t* out = p.out + int64_t{row} * (p.prefix_budget + p.append);
    int n = 0;
    for (int b = 0; b < n_blocks; ++b) {
      const int len = selected[b] ? block_size(b) : (b == partial_block ? partial_len : 0);
      for (int j = b * p.block; j < b * p.block + len; ++j) out[n++] = j;
    }
    for (int j = 0; j < p.append; ++j) out[n++] = p.prefix + j;
  }
}

void GatherKv(const GatherKvParams& p) {
  const int per_kv = p.n_cache_heads / p.n_kv_heads;
  for (int c = 0; c < p.n_cache_heads; ++c) {
    const int64_t g = int64_t{c / per_kv} * p.head_dim;
    for (int t = 0; t < p.count; ++t) {
      const int64_t tok = p.kept[int64_t{c} * p.count + t];
      const int64_t dst = (int64_t{c} * p.count + t) * p.head_dim;
      for (int i = 0; i < p.head_dim; ++i) {
        Store(p.k_out, p.dtype, dst + i, p.k[tok * p.kv_stride + g + i]);
        Store(p.v_out, p.dtype, dst + i, p.v[tok * p.kv_stride + g + i]);
      }
    }
  }
}

void UpdateSummaries(const UpdateSummariesParams& p) {
  for (int i = 0; i < p.count; ++i) {
    const SummaryUpdateSegment& s = p.segs[i];
    const SummaryLayout& l = s.layout;
    std::vector<float> row(l.head_dim);
    for (int c = 0; c < s.n_heads; ++c) {
      for (int page = s.first / l.page; page < l.pages(s.len); ++page) {
        for (int d = 0; d < l.head_dim; ++d) {
          float lo = std::numeric_limits<float>::infinity();
          float hi = -std::numeric_limits<float>::infinity();
          for (int t = page * l.page; t < std::min(s.len, (page + 1) * l.page); ++t) {
            float v;
            if (s.coding.coded()) {
              CodedKeyRow(s.k, s.kv, s.coding, l.dtype, l.head_dim, s.len, c, t, row.data());
              v = row[d];
            } else {
              v = Load(s.k, l.dtype, s.kv.Row(c, t, l.head_dim) + d);
            }
            lo = std::min(lo, v);
            hi = std::max(hi, v);
          }
          const int64_t head = c * l.head_elems();
          Store(s.summaries, l.dtype, head + l.Offset(false, d, page), lo);
          if (l.sets() == 2) Store(s.summaries, l.dtype, head + l.Offset(true, d, page), hi);
        }
      }
    }
  }
}

namespace {

void HybridScores(const PageScoreSegment& s, int d, DType dtype) {
  const SummaryLayout& l = s.layout;
  const int group = s.group, r = std::min(s.top_r, d), n_pages = l.pages(s.len);
  // Line 3: the r dimensions with the largest Σ_g |q_g|, best first.
  std::vector<float> a(d, 0.f), sum(d, 0.f);
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < d; ++i) {
      a[i] += std::fabs(s.q[g * d + i]);
      sum[i] += s.q[g * d + i];
    }
  }
  std::vector<int32_t> dims = RankBestFirst(a);
  dims.resize(r);
  // Lines 4-6, per query head: page logits over those dimensions, SparQ-scaled.
  std::vector<std::vector<float>> e(group, std::vector<float>(n_pages));
  std::vector<float> inv_z(group);
  for (int g = 0; g < group; ++g) {
    const float* q = s.q + g * d;
    float num = 0.f, den = 0.f;
    for (int x = 0; x < r; ++x) num += std::fabs(q[dims[x]]);
    for (int i = 0; i < d; ++i) den += std::fabs(q[i]);
    const float inv_scale = den > 0.f && num > 0.f ? 1.f / std::sqrt(d * num / den) : 1.f;
    float mx = -std::numeric_limits<float>::infinity();
    for (int page = 0; page < n_pages; ++page) {
      float u = 0.f;
      for (int x = 0; x < r; ++x) {
        const bool max = sum[dims[x]] >= 0.f;
        u += q[dims[x]] * Load(s.summaries, dtype, l.Offset(max, dims[x], page));
      }
      e[g][page] = u * inv_scale;
      mx = std::max(mx, e[g][page]);
    }
    // A softmax over slots: every page but the last holds `page` slots with its logit.
    float z = 0.f;
    for (float& v : e[g]) z += v = std::exp(v - mx);
    const int last_slots = s.len - (n_pages - 1) * l.page;
    inv_z[g] = 1.f / (z * l.page - e[g][n_pages - 1] * static_cast<float>(l.page - last_slots));
  }
  for (int page = 0; page < n_pages; ++page) {
    float total = 0.f;
    for (int g = 0; g < group; ++g) total += inv_z[g] * e[g][page];
    s.score[page] = total;
  }
}

void QuestScores(const PageScoreSegment& s, int d, DType dtype) {
  const SummaryLayout& l = s.layout;
  for (int page = 0; page < l.pages(s.len); ++page) {
    float bound = 0.f;
    for (int i = 0; i < d; ++i) {
      for (int g = 0; g < s.group; ++g) {
        const float q = s.q[g * d + i];
        bound += q * Load(s.summaries, dtype, l.Offset(q >= 0.f, i, page));
      }
    }
    s.score[page] = bound;
  }
}

void ExactScores(const PageScoreSegment& s, int d, DType dtype) {
  std::fill(s.score, s.score + s.len, 0.f);
  std::vector<float> e(s.len), row(d);
  for (int g = 0; g < s.group; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < s.len; ++t) {
      float dot = 0.f;
      if (s.coding.coded()) {
        CodedKeyRow(s.k, s.kv, s.coding, dtype, d, s.len, s.head, t, row.data());
        for (int i = 0; i < d; ++i) dot += s.q[g * d + i] * row[i];
      } else {
        for (int i = 0; i < d; ++i)
          dot += s.q[g * d + i] * Load(s.k, dtype, s.kv.Row(s.head, t, d) + i);
      }
      e[t] = dot * s.scale;
      mx = std::max(mx, e[t]);
    }
    double z = 0;
    for (int t = 0; t < s.len; ++t) z += e[t] = std::exp(e[t] - mx);
    for (int t = 0; t < s.len; ++t) s.score[t] += static_cast<float>(e[t] / z);
  }
}

}  // namespace

void PageScores(const PageScoresParams& p) {
  for (int i = 0; i < p.count; ++i) {
    const PageScoreSegment& s = p.segs[i];
    switch (s.kind) {
      case PageScoreKind::kHybrid:
        HybridScores(s, p.head_dim, p.dtype);
        break;
      case PageScoreKind::kQuest:
        QuestScores(s, p.head_dim, p.dtype);
        break;
      case PageScoreKind::kExact:
        ExactScores(s, p.head_dim, p.dtype);
        break;
    }
  }
}

void Sample(const SampleParams& p) {
  const int64_t stride = p.stride ? p.stride : p.vocab;
  for (int b = 0; b < p.batch; ++b) {
    p.out[b] = SampleReference(p.logits + b * stride, p.vocab, p.rows[b].params, p.rows[b].uniform);
  }
}

}  // namespace kvwire::kernels::reference
