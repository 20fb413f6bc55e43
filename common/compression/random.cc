// `random`: uniformly random prefix positions plus the window, seeded per (layer, head):
// the floor any scoring policy must beat.
#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/base/splitmix.h"
#include "common/base/status.h"
#include "common/compression/policy.h"

namespace kvwire {
namespace {

absl::StatusOr<PolicyPtr> MakeRandom(const ParamValues& values);

const PolicyInfo& Info() {
  static const PolicyInfo* const info =
      new PolicyInfo{"random",
                     "uniformly random prefix positions + the window",
                     "baseline",
                     {{"seed", "0", "seed of the random policy"}},
                     &MakeRandom};
  return *info;
}

struct RandomParams {
  uint64_t seed = 0;
};

uint64_t Mix(uint64_t x) { return SplitMix64(x); }

// n distinct positions of [0, prefix), uniformly (partial Fisher-Yates), sorted.
std::vector<int32_t> RandomSelect(int prefix, int n, uint64_t seed) {
  std::vector<int32_t> all(prefix);
  std::iota(all.begin(), all.end(), 0);
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

class Random final : public CompressionPolicy {
 public:
  explicit Random(RandomParams p) : p_(p) {}
  const PolicyInfo& info() const override { return Info(); }
  ParamValues params() const override { return {{"seed", absl::StrCat(p_.seed)}}; }
  bool uses_scores() const override { return false; }

  absl::StatusOr<KeptRows> SelectPrefix(const LayerInput& in, PromptState*) const override {
    KeptRows kept;
    for (int h = 0; h < in.cache_heads; ++h) {
      const uint64_t seed = Mix(p_.seed ^ Mix(static_cast<uint64_t>(in.layer) << 32 | h));
      kept.push_back(RandomSelect(in.prefix, in.prefix_budget, seed));
    }
    return kept;
  }

 private:
  RandomParams p_;
};

absl::StatusOr<PolicyPtr> MakeRandom(const ParamValues& values) {
  RandomParams p;
  ParamReader reader(Info(), values);
  RETURN_IF_ERROR(reader.Uint64("seed", &p.seed));
  RETURN_IF_ERROR(reader.Finish());
  return std::make_shared<Random>(p);
}

}  // namespace

const PolicyInfo& RandomPolicyInfo() { return Info(); }

}  // namespace kvwire
