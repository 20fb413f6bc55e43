#include "kernels/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace kvwire::kernels {
namespace {

std::vector<float> RandomLogits(int vocab, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(vocab);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(Sampling, GreedyIsArgmaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.f, 3.f, -1.f, 3.f, 2.f};
  const SampledToken t = Sample(logits.data(), 5, {0.f, 0, 1.f}, 0.99);
  EXPECT_EQ(t.id, 1);
  // log softmax of 3 over {0,3,-1,3,2}
  const double z = std::exp(0.) + 2 * std::exp(3.) + std::exp(-1.) + std::exp(2.);
  EXPECT_NEAR(t.logprob, 3.0 - std::log(z), 1e-5);
}

TEST(Sampling, FastAgreesWithReference) {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int checked = 0;
  for (int vocab : {1, 7, 37, 512, 5000}) {
    for (float temperature : {0.f, 0.5f, 1.f, 1.7f}) {
      for (int top_k : {0, 1, 5, 50}) {
        for (float top_p : {1.f, 0.9f, 0.3f, 0.01f}) {
          for (int trial = 0; trial < 5; ++trial) {
            const auto logits = RandomLogits(vocab, 1000 * vocab + trial, 2.f);
            const SamplingParams p{temperature, top_k, top_p};
            const double x = u(rng);
            const SampledToken a = Sample(logits.data(), vocab, p, x);
            const SampledToken b = SampleReference(logits.data(), vocab, p, x);
            ASSERT_EQ(a.id, b.id) << "vocab=" << vocab << " T=" << temperature << " top_k=" << top_k
                                  << " top_p=" << top_p << " u=" << x;
            ASSERT_FLOAT_EQ(a.logprob, b.logprob);
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 5 * 4 * 4 * 4 * 5);
}

TEST(Sampling, TopKOneAndTinyTopPAreGreedy) {
  const auto logits = RandomLogits(300, 7, 1.f);
  const int32_t best = Sample(logits.data(), 300, {0.f, 0, 1.f}, 0.5).id;
  for (double x : {0.0, 0.3, 0.999}) {
    EXPECT_EQ(Sample(logits.data(), 300, {1.f, 1, 1.f}, x).id, best);
    EXPECT_EQ(Sample(logits.data(), 300, {1.f, 0, 1e-6f}, x).id, best);
  }
}

TEST(Sampling, TopKNeverLeavesTheTopK) {
  const auto logits = RandomLogits(100, 3, 1.f);
  std::vector<int> order(100);
  for (int i = 0; i < 100; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  std::set<int> top(order.begin(), order.begin() + 5);
  for (int i = 0; i < 200; ++i) {
    EXPECT_TRUE(top.count(Sample(logits.data(), 100, {2.f, 5, 1.f}, i / 200.0).id));
  }
}

TEST(Sampling, FrequenciesFollowTheSoftmax) {
  // Stratified uniforms make the empirical distribution exact up to 1/N per token.
  const std::vector<float> logits = {1.f, 2.f, 0.f, 2.5f};
  const float temperature = 0.8f;
  std::vector<double> p(4);
  double z = 0;
  for (int i = 0; i < 4; ++i) z += p[i] = std::exp(logits[i] / temperature);
  const int n = 10000;
  std::map<int, int> counts;
  for (int i = 0; i < n; ++i) {
    ++counts[Sample(logits.data(), 4, {temperature, 0, 1.f}, (i + 0.5) / n).id];
  }
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(counts[i] / double(n), p[i] / z, 2.0 / n) << i;
}

}  // namespace
}  // namespace kvwire::kernels
