// Compression overhead: prefill time with each policy against prefill with the full cache,
// measured interleaved in the same iterations (full, policy, full, policy, ...) so machine
// noise hits both alike; the `overhead` counter is policy time / full time.
//
//   stories:  the real stories260K on ../shared/data/stories/dev.jsonl prompts (353-469 tokens)
//   synth4k:  a 4096-token prompt on a synthetic model (2 layers, hidden 1024, 16/4 heads)
// Run: build/bench/compression_bench
#include <benchmark/benchmark.h>

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/engine/generate.h"

namespace kvwire {
namespace {

struct Setup {
  std::unique_ptr<LlamaModel> model;
  std::vector<std::vector<int32_t>> prompts;
};

Setup* GetSetup(const std::string& name) {
  static auto* setups = new std::map<std::string, std::unique_ptr<Setup>>();
  auto it = setups->find(name);
  if (it != setups->end()) return it->second.get();
  auto s = std::make_unique<Setup>();
  LoadOptions opts;
  opts.threads = 2;
  if (name == "stories") {
    const std::string shared = std::string(KVWIRE_SOURCE_DIR) + "/../shared";
    auto m = LlamaModel::Load(shared + "/models/stories260K-hf", opts);
    if (!m.ok()) return nullptr;
    s->model = std::move(*m);
    std::ifstream in(shared + "/data/stories/dev.jsonl");
    std::string line;
    while (std::getline(in, line) && s->prompts.size() < 20) {
      s->prompts.push_back(nlohmann::json::parse(line)["prompt_ids"].get<std::vector<int32_t>>());
    }
  } else {
    auto m = LlamaModel::Load(
        "synthetic:llama-1b,layers=2,hidden=1024,heads=16,kv_heads=4,head_dim=64,ffn=2816,"
        "vocab=2048,dtype=f32",
        opts);
    if (!m.ok()) return nullptr;
    s->model = std::move(*m);
    std::vector<int32_t> ids(4096);
    for (int i = 0; i < 4096; ++i) ids[i] = 3 + (i * 977) % 2000;
    s->prompts.push_back(ids);
  }
  return (*setups)[name] = std::move(s), (*setups)[name].get();
}

double TimePrefill(LlamaModel& m, const std::vector<int32_t>& ids, const CompressionConfig& c) {
  const auto t0 = std::chrono::steady_clock::now();
  auto seq = PrefillSequence(m, ids, c, 1);
  benchmark::DoNotOptimize(seq);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void BM_Overhead(benchmark::State& state, const std::string& setup, const std::string& policy,
                 int budget) {
  Setup* s = GetSetup(setup);
  if (s == nullptr) {
    state.SkipWithError("model or data not available");
    return;
  }
  CompressionConfig c;
  c.policy = *MakePolicy(policy);
  if (c.policy->evicts()) {
    c.budget = budget;
    c.window = setup == "stories" ? 16 : 32;
  }
  double full = 0, pol = 0, selecting = 0;
  size_t i = 0;
  for (auto _ : state) {
    const auto& ids = s->prompts[i++ % s->prompts.size()];
    full += TimePrefill(*s->model, ids, CompressionConfig{});
    pol += TimePrefill(*s->model, ids, c);
    auto seq = PrefillSequence(*s->model, ids, c, 1);
    selecting += seq.ok() ? seq->compress_seconds : 0;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["full_ms"] = 1e3 * full / n;
  state.counters["policy_ms"] = 1e3 * pol / n;
  state.counters["select_ms"] = 1e3 * selecting / n;
  state.counters["overhead"] = pol / full;
}

void Register(const std::string& setup, int budget, int iterations) {
  for (const PolicyInfo* info : Policies()) {
    if (!MakePolicy(info->name).value()->selects()) continue;  // rocketkv: a two-stage split
    const std::string p = info->name;
    benchmark::RegisterBenchmark(("Overhead/" + setup + "/" + p).c_str(),
                                 [=](benchmark::State& st) { BM_Overhead(st, setup, p, budget); })
        ->Iterations(iterations)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) {
  kvwire::Register("stories", 64, 40);
  kvwire::Register("synth4k", 512, 3);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
