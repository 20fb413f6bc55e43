#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/base/ranking.h"

namespace kvwire::kernels {
namespace {

struct Candidate {
  float p;  // unnormalised probability exp((logit - max) / T)
  int32_t id;
};

// The ranking order (common/base/ranking.h): the larger probability, NaN last (a +∞ logit
// makes NaNs), then the lower id. A strict weak order with NaN too, as the sorts need, and the
// order the device's keys sort in.
bool Before(const Candidate& a, const Candidate& b) {
  if (ScoreBefore(a.p, b.p)) return true;
  if (ScoreBefore(b.p, a.p)) return false;
  return a.id < b.id;
}

int32_t Argmax(const float* logits, int vocab) {
  int32_t best = 0;
  for (int i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

float LogProb(const float* logits, int vocab, int32_t id) {
  const float mx = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
  return static_cast<float>(logits[id] - mx - std::log(sum));
}

// Given candidates sorted by Before, keeps the top-k / top-p prefix and draws from it.
int32_t DrawFromSorted(const std::vector<Candidate>& sorted, size_t available, double total,
                       const SamplingParams& params, double uniform) {
  size_t keep = available;
  if (params.top_k > 0) keep = std::min(keep, static_cast<size_t>(params.top_k));
  if (params.top_p < 1.f) {
    const double target = params.top_p * total;
    double cum = 0;
    size_t i = 0;
    for (; i < keep; ++i) {
      cum += sorted[i].p;
      if (cum >= target) break;
    }
    keep = std::min(keep, i + 1);  // the smallest prefix reaching top_p, at least one
  }
  double mass = 0;
  for (size_t i = 0; i < keep; ++i) mass += sorted[i].p;
  const double threshold = uniform * mass;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += sorted[i].p;
    if (cum > threshold) return sorted[i].id;
  }
  return sorted[keep - 1].id;
}

std::vector<Candidate> Candidates(const float* logits, int vocab, float temperature,
                                  double* total) {
  const float mx = *std::max_element(logits, logits + vocab);
  std::vector<Candidate> c(vocab);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) {
    c[i] = {std::exp((logits[i] - mx) / temperature), i};
    sum += c[i].p;
  }
  *total = sum;
  return c;
}

}  // namespace

SampledToken SampleReference(const float* logits, int vocab, const SamplingParams& params,
                             double uniform) {
  SampledToken out;
  if (params.temperature <= 0.f) {
    out.id = Argmax(logits, vocab);
  } else {
    double total = 0;
    std::vector<Candidate> c = Candidates(logits, vocab, params.temperature, &total);
    std::sort(c.begin(), c.end(), Before);
    out.id = DrawFromSorted(c, c.size(), total, params, uniform);
  }
  out.logprob = LogProb(logits, vocab, out.id);
  return out;
}

SampledToken Sample(const float* logits, int vocab, const SamplingParams& params, double uniform) {
  SampledToken out;
  if (params.temperature <= 0.f) {
    out.id = Argmax(logits, vocab);
    out.logprob = LogProb(logits, vocab, out.id);
    return out;
  }
  double total = 0;
  std::vector<Candidate> c = Candidates(logits, vocab, params.temperature, &total);
  // Sort only as far as the truncation can reach: top-k bounds it directly; for top-p,
  // grow a sorted prefix until its mass reaches top_p (a few hundred tokens in practice).
  size_t sorted =
      std::min(c.size(), params.top_k > 0 ? static_cast<size_t>(params.top_k) : size_t{64});
  for (;;) {
    std::partial_sort(c.begin(), c.begin() + sorted, c.end(), Before);
    if (sorted == c.size() || params.top_k > 0) break;
    if (params.top_p < 1.f) {
      double cum = 0;
      for (size_t i = 0; i < sorted; ++i) cum += c[i].p;
      if (cum >= params.top_p * total) break;
    }
    sorted = std::min(c.size(), sorted * 4);
  }
  out.id = DrawFromSorted(c, sorted, total, params, uniform);
  out.logprob = LogProb(logits, vocab, out.id);
  return out;
}

}  // namespace kvwire::kernels
