#include "common/compression/scoring.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kvwire {

const std::vector<absl::string_view>& PoolNames() {
  static const auto* const kNames = new std::vector<absl::string_view>{"max", "avg"};
  return *kNames;
}

const std::vector<absl::string_view>& GqaNames() {
  static const auto* const kNames =
      new std::vector<absl::string_view>{"per_query_head", "sum", "mean", "max"};
  return *kNames;
}

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

std::vector<float> Pool1d(const std::vector<float>& x, int kernel, PoolKind kind) {
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

std::vector<float> RunMeans(const std::vector<float>& x, int size) {
  const int n = static_cast<int>(x.size());
  std::vector<float> means((n + size - 1) / size);
  for (size_t m = 0; m < means.size(); ++m) {
    const int lo = static_cast<int>(m) * size, hi = std::min(n, lo + size);
    float s = 0.f;
    for (int j = lo; j < hi; ++j) s += x[j];
    means[m] = s / static_cast<float>(hi - lo);
  }
  return means;
}

}  // namespace kvwire
