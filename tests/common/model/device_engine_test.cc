// The engine's device path (weights, activations and KV caches in backend memory the host
// reaches only through copies) against the CPU engine (the specification) and
// ../shared/models/stories260K-hf/REFERENCE.json: greedy ids equal to the reference's,
// decode steps that reproduce prefill logits, batches of mixed cache layouts, compressed
// prefill into device decode, and on synthetic:llama-1b (bf16, 16 layers) 32 greedy steps
// that agree with the CPU engine's.
//
// Each test runs on two backends: `guarded` (the CPU kernels on memory the host cannot touch
// between ops, so any direct host access to device memory crashes the test: the path's
// bookkeeping, on every machine) and `cuda` (the GPU kernels too, where a GPU is present:
// scripts/device_run.sh; elsewhere it skips, saying why).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/compression/compression.h"
#include "common/compression/policy.h"
#include "common/engine/generate.h"
#include "common/model/llama_model.h"
#include "common/sparse/attention.h"
#include "kernels/backend.h"
#include "kernels/guarded_backend.h"
#include "tests/engine_fakes.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

using nlohmann::json;
using testing::Greedy;

class DeviceEngine : public ::testing::TestWithParam<kernels::BackendKind> {
 protected:
  void SetUp() override {
    if (GetParam() == kernels::BackendKind::kCuda && !kernels::CudaAvailable()) {
      GTEST_SKIP() << "no GPU: the engine's CUDA path runs where one is present "
                      "(scripts/device_run.sh)";
    }
  }
  kernels::BackendKind device() const { return GetParam(); }
};

LoadOptions On(kernels::BackendKind backend, std::optional<DType> dtype = std::nullopt) {
  LoadOptions o;
  o.backend = backend;
  o.weight_dtype = dtype;
  return o;
}

std::unique_ptr<LlamaModel> Load(const std::string& spec, const LoadOptions& options) {
  auto m = LlamaModel::Load(spec, options);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

std::vector<int32_t> Ids(const json& j) { return j.get<std::vector<int32_t>>(); }

CompressionConfig SnapKv(int budget) {
  CompressionConfig c;
  c.policy = *MakePolicy("snapkv");
  c.budget = budget;
  return c;
}

DecodeAttentionConfig Hybrid(int token_budget) {
  DecodeAttentionConfig a;
  a.mode = AttentionMode::kHybrid;
  a.token_budget = token_budget;
  return a;
}

// The device engine generates the CPU engine's tokens, their log-probabilities within 1e-3.
void ExpectSameGeneration(LlamaModel& cpu, LlamaModel& dev, const GenerationRequest& req) {
  auto want = Generate(cpu, req);
  auto got = Generate(dev, req);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->ids, want->ids);
  ASSERT_EQ(got->logprobs.size(), want->logprobs.size());
  for (size_t i = 0; i < got->logprobs.size(); ++i) {
    EXPECT_NEAR(got->logprobs[i], want->logprobs[i], 1e-3) << i;
  }
}

TEST_P(DeviceEngine, StoriesGreedyIdsEqualTheReference) {
  KVWIRE_REQUIRE_SHARED();
  auto dev = Load(testing::StoriesModelDir(), On(device()));
  ASSERT_NE(dev, nullptr);
  const json ref = json::parse(testing::ReadFile(testing::StoriesModelDir() + "/REFERENCE.json"));
  for (const char* run : {"greedy_from_bos", "greedy_from_prompt"}) {
    EXPECT_EQ(Greedy(*dev, Ids(ref[run]["prompt_ids"]), ref[run]["max_new_tokens"].get<int>()),
              Ids(ref[run]["ids"]))
        << run;
  }
  // Teacher-forced NLL within 1e-3 of the reference's.
  EXPECT_NEAR(testing::SumNll(*dev, Ids(ref["teacher_forced"]["ids"])),
              ref["teacher_forced"]["sum_nll"].get<double>(), 1e-3);

  // bf16 weights (uploaded as stored after the conversion): the first 32 greedy tokens.
  auto bf16 = Load(testing::StoriesModelDir(), On(device(), DType::kBF16));
  ASSERT_NE(bf16, nullptr);
  for (const char* run : {"greedy_from_bos", "greedy_from_prompt"}) {
    const auto want = Ids(ref[run]["ids"]);
    EXPECT_EQ(Greedy(*bf16, Ids(ref[run]["prompt_ids"]), 32),
              std::vector<int32_t>(want.begin(), want.begin() + 32))
        << run;
  }
}

// Prefill logits agree between the engines, and token-by-token decode on the device gives the
// CPU engine's decode logits (and, with f32 caches, its prefill's over the whole sequence; bf16
// caches round K and V, which prefill attention does not).
TEST_P(DeviceEngine, DecodeStepsEqualTheCpuEngine) {
  for (const char* spec : {"synthetic:tiny", "synthetic:tiny,dtype=bf16"}) {
    SCOPED_TRACE(spec);
    auto cpu = Load(spec, On(kernels::BackendKind::kCpu));
    auto dev = Load(spec, On(device()));
    ASSERT_TRUE(cpu && dev);
    EXPECT_EQ(cpu->fingerprint(), dev->fingerprint());
    const int vocab = cpu->config().vocab_size;
    const bool f32 = cpu->kv_dtype() == DType::kF32;
    // bf16 weights round each product's input to bf16: where the GPU's float32 sums (cuBLAS,
    // another order) differ from the CPU's in their last bits, a rounding can land one bf16
    // step (2^-8 relative) away and carry into the next layer (docs/benchmarks.md, "GPU").
    // f32 models keep the tight bound.
    const float abs_tol = f32 ? 2e-4f : 2e-3f, rel_tol = f32 ? 2e-3f : 1e-2f;
    std::vector<int32_t> ids;
    for (int i = 0; i < 40; ++i) ids.push_back(3 + (i * 37) % (vocab - 3));
    auto full = cpu->Prefill(ids, nullptr, true);
    auto full_dev = dev->Prefill(ids, nullptr, true);
    ASSERT_TRUE(full.ok() && full_dev.ok());
    for (size_t i = 0; i < full->logits.size(); ++i) {
      ASSERT_NEAR(full_dev->logits[i], full->logits[i],
                  abs_tol + rel_tol * std::fabs(full->logits[i]))
          << i;
    }
    const int p = 25;
    auto prompt = absl::MakeConstSpan(ids).subspan(0, p);
    auto seq_cpu = PrefillSequence(*cpu, prompt, CompressionConfig{}, 64);
    auto seq_dev = PrefillSequence(*dev, prompt, CompressionConfig{}, 64);
    ASSERT_TRUE(seq_cpu.ok() && seq_dev.ok()) << seq_cpu.status() << seq_dev.status();
    std::vector<float> want(vocab), got(vocab);
    for (int i = p; i < 40; ++i) {
      DecodeInput a{ids[i], i, seq_cpu->cache.get(), nullptr};
      DecodeInput b{ids[i], i, seq_dev->cache.get(), nullptr};
      ASSERT_TRUE(cpu->DecodeStep({&a, 1}, want.data()).ok());
      const absl::Status st = dev->DecodeStep({&b, 1}, got.data());
      ASSERT_TRUE(st.ok()) << st;
      for (int v = 0; v < vocab; ++v) {
        ASSERT_NEAR(got[v], want[v], abs_tol + rel_tol * std::fabs(want[v]))
            << "position " << i << " token " << v;
        if (f32) {
          const float whole = full->logits[int64_t{i} * vocab + v];
          ASSERT_NEAR(got[v], whole, 2e-4 + 2e-3 * std::fabs(whole))
              << "position " << i << " token " << v;
        }
      }
    }
  }
}

// A batch mixing caches compressed per KV head and per query head (SnapKV under GQA), of
// different lengths, prefilled on the host engine and decoded on the device: each sequence's
// logits equal the CPU engine's decode of the same cache.
TEST_P(DeviceEngine, MixedBatchOfCompressedCachesEqualsTheCpuEngine) {
  auto cpu = Load("synthetic:tiny", On(kernels::BackendKind::kCpu));
  auto dev = Load("synthetic:tiny", On(device()));
  ASSERT_TRUE(cpu && dev);
  const int vocab = cpu->config().vocab_size;
  struct Case {
    const char* policy;
    ParamValues params;
    int len;
  };
  const std::vector<Case> cases = {
      {"snapkv", {}, 90}, {"snapkv", {{"gqa", "per_query_head"}}, 70}, {"full", {}, 33}};
  std::vector<std::unique_ptr<KvCache>> on_cpu, on_dev;
  std::vector<int> lens;
  for (const Case& c : cases) {
    CompressionConfig cc;
    auto policy = MakePolicy(c.policy, c.params);
    ASSERT_TRUE(policy.ok()) << policy.status();
    cc.policy = std::move(*policy);
    cc.budget = c.policy == std::string("full") ? 0 : 24;
    std::vector<int32_t> ids;
    for (int i = 0; i < c.len; ++i) ids.push_back(5 + (i * 13 + c.len) % (vocab - 5));
    // The device model prefills and compresses (its observer reads host copies of K/V); the
    // CPU model does the same from its own prefill.
    auto a = PrefillSequence(*cpu, ids, cc, 8);
    auto b = PrefillSequence(*dev, ids, cc, 8);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    on_cpu.push_back(std::move(a->cache));
    on_dev.push_back(std::move(b->cache));
    lens.push_back(c.len);
  }
  EXPECT_NE(on_dev[0]->shape().n_heads, on_dev[1]->shape().n_heads);
  const int bsz = static_cast<int>(cases.size());
  std::vector<float> want(bsz * vocab), got(bsz * vocab);
  for (int step = 0; step < 6; ++step) {
    std::vector<DecodeInput> a, b;
    for (int i = 0; i < bsz; ++i) {
      a.push_back({40 + step + i, lens[i] + step, on_cpu[i].get(), nullptr});
      b.push_back({40 + step + i, lens[i] + step, on_dev[i].get(), nullptr});
    }
    ASSERT_TRUE(cpu->DecodeStep(a, want.data()).ok());
    const absl::Status st = dev->DecodeStep(b, got.data());
    ASSERT_TRUE(st.ok()) << st;
    for (int i = 0; i < bsz * vocab; ++i) {
      ASSERT_NEAR(got[i], want[i], 2e-4 + 2e-3 * std::fabs(want[i]))
          << "step " << step << " sequence " << i / vocab;
    }
  }
}

// Sparse decode on the device path (selection on the host, attention over the chosen rows on
// the device) gives the CPU engine's tokens and logprobs, for every attention mode, dense
// layers first, over a full and a SnapKV-compressed cache, greedy and sampled.
TEST_P(DeviceEngine, SparseDecodeEqualsTheCpuEngine) {
  auto cpu = Load("synthetic:tiny", On(kernels::BackendKind::kCpu));
  auto dev = Load("synthetic:tiny", On(device()));
  ASSERT_TRUE(cpu && dev);
  const int vocab = cpu->config().vocab_size;
  std::vector<int32_t> prompt = {1};
  for (int i = 0; i < 90; ++i) prompt.push_back(5 + (i * 29) % (vocab - 5));
  struct Case {
    const char* name;
    AttentionMode mode;
    int top_k, top_r, page;
    bool compressed;
  };
  const std::vector<Case> cases = {{"quest", AttentionMode::kQuest, 16, 0, 4, false},
                                   {"hybrid", AttentionMode::kHybrid, 16, 4, 4, false},
                                   {"exact_topk", AttentionMode::kExactTopK, 12, 0, 0, false},
                                   {"hybrid over snapkv", AttentionMode::kHybrid, 12, 4, 4, true}};
  for (const Case& c : cases) {
    for (bool sampled : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (sampled ? " sampled" : " greedy"));
      GenerationRequest req;
      req.prompt_ids = prompt;
      req.max_tokens = 12;
      req.attention.mode = c.mode;
      req.attention.top_k = c.top_k;
      req.attention.top_r = c.top_r;
      req.attention.page_size = c.page;
      if (c.compressed) {
        req.compression.policy = *MakePolicy("snapkv");
        req.compression.budget = 40;
      }
      if (sampled) {
        req.sampling = {0.8f, 0, 0.9f};
        req.seed = 11;
      }
      ExpectSameGeneration(*cpu, *dev, req);
    }
  }
}

// A coded KV format's cache kept coded in the device's pool (paged, its group parameters and
// residual in runs of the pool's pages) decodes as the CPU engine's coded cache does, densely and
// sparsely, past the appended tokens' first groups (coded on the device by AppendKv).
TEST_P(DeviceEngine, CodedCachesEqualTheCpuEngine) {
  auto cpu = Load("synthetic:tiny", On(kernels::BackendKind::kCpu));
  auto dev = Load("synthetic:tiny", On(device()));
  ASSERT_TRUE(cpu && dev);
  const int vocab = cpu->config().vocab_size;
  std::vector<int32_t> prompt = {1};
  for (int i = 0; i < 90; ++i) prompt.push_back(5 + (i * 31) % (vocab - 5));
  for (KvFormat format : {KvFormat::kFP8, KvFormat::kInt8, KvFormat::kInt4}) {
    for (AttentionMode mode : {AttentionMode::kDense, AttentionMode::kHybrid}) {
      SCOPED_TRACE(absl::StrCat(KvFormatName(format), " ", AttentionModeName(mode)));
      GenerationRequest req;
      req.prompt_ids = prompt;
      req.max_tokens = 140;
      req.compression.policy = *MakePolicy("snapkv");
      req.compression.budget = 40;
      req.compression.kv_format = format;
      req.attention.mode = mode;
      if (mode == AttentionMode::kHybrid) {
        req.attention.top_k = 16;
        req.attention.top_r = 4;
        req.attention.page_size = 4;
      }
      ExpectSameGeneration(*cpu, *dev, req);
    }
  }
}

// What crosses between host and device (the backend's copy ledger): a compressing prefill
// copies to the host only the kept rows, their positions and the last position's logits; a
// sparse decode step of a batch only each sequence's sampled token and log-probability, with
// no copy per layer.
TEST_P(DeviceEngine, OnlyTheKeptRowsAndTheSampledTokensComeBack) {
  auto dev = Load("synthetic:tiny,layers=3", On(device()));
  ASSERT_NE(dev, nullptr);
  const ModelConfig& c = dev->config();
  std::vector<int32_t> prompt = {1};
  for (int i = 0; i < 199; ++i) prompt.push_back(5 + (i * 31) % (c.vocab_size - 5));
  const CompressionConfig snapkv = SnapKv(64);
  const DecodeAttentionConfig hybrid = Hybrid(32);
  const int batch = 4, steps = 5;
  std::vector<PrefilledSequence> seqs;
  std::vector<std::unique_ptr<DecodeSelector>> selectors;
  for (int b = 0; b < batch; ++b) {
    const auto before = dev->copy_counts();
    auto seq = PrefillSequence(*dev, prompt, snapkv, steps + 1);
    ASSERT_TRUE(seq.ok()) << seq.status();
    const auto prefill = dev->copy_counts() - before;
    // Per layer: positions (4 bytes) and K and V rows of every kept token of every KV head.
    const int64_t payload = int64_t{c.num_layers} * c.num_kv_heads * snapkv.budget *
                            (4 + 2 * c.head_dim * DTypeSize(dev->kv_dtype()));
    EXPECT_LE(prefill.to_host_bytes, payload + int64_t{c.vocab_size} * 4);
    EXPECT_GE(prefill.to_host_bytes, payload);
    EXPECT_EQ(seq->cache->StoredBytes(), int64_t{c.num_layers} * c.num_kv_heads * snapkv.budget *
                                             2 * c.head_dim *
                                             static_cast<int64_t>(DTypeSize(dev->kv_dtype())));
    auto sel = MakeDecodeSelector(hybrid, c, seq->cache->shape(), HeapKvAllocator());
    ASSERT_TRUE(sel.ok()) << sel.status();
    selectors.push_back(std::move(*sel));
    seqs.push_back(std::move(*seq));
  }
  std::vector<int32_t> tokens(batch, 7);
  for (int s = 0; s < steps; ++s) {
    std::vector<DecodeInput> in;
    std::vector<kernels::SampleRow> rows(batch);
    for (int b = 0; b < batch; ++b) {
      in.push_back({tokens[b], static_cast<int32_t>(prompt.size()) + s, seqs[b].cache.get(),
                    selectors[b].get()});
    }
    std::vector<kernels::SampledToken> out(batch);
    const auto before = dev->copy_counts();
    const absl::Status st = dev->DecodeStepSampled(in, rows, out.data());
    ASSERT_TRUE(st.ok()) << st;
    const auto step = dev->copy_counts() - before;
    EXPECT_EQ(step.to_host_calls, 1) << "step " << s;
    EXPECT_EQ(step.to_host_bytes, batch * static_cast<int64_t>(sizeof(kernels::SampledToken)));
    for (int b = 0; b < batch; ++b) tokens[b] = out[b].id;
  }
}

// A step as one graph (LoadOptions::decode_graphs, the default) gives the tokens and
// log-probabilities of the same step op by op, batch sizes coming and going, a sparse
// sequence (hybrid attention) among dense ones: one graph made per batch size, updated in place
// on the steps after, and one copy to the host a step.
TEST_P(DeviceEngine, DecodeGraphsEqualStepsOpByOp) {
  for (const char* spec : {"synthetic:tiny,layers=3", "synthetic:tiny,layers=3,dtype=bf16"}) {
    SCOPED_TRACE(spec);
    auto dev = Load(spec, On(device()));
    ASSERT_NE(dev, nullptr);
    ASSERT_TRUE(dev->decode_graphs());
    const ModelConfig& c = dev->config();
    const CompressionConfig snapkv = SnapKv(24);
    const DecodeAttentionConfig hybrid = Hybrid(16);
    const int batch = 3, steps = 12;
    // Two copies of each sequence, of different lengths: one stepped as graphs, one op by op.
    // The first attends sparsely, with a selector for each copy.
    std::vector<PrefilledSequence> graphed, eager;
    std::vector<std::unique_ptr<DecodeSelector>> selectors;
    for (int b = 0; b < batch; ++b) {
      std::vector<int32_t> prompt;
      for (int i = 0; i < 40 + 9 * b; ++i) prompt.push_back(3 + (i * 31 + b) % (c.vocab_size - 3));
      for (auto* set : {&graphed, &eager}) {
        auto seq = PrefillSequence(*dev, prompt, b == 1 ? CompressionConfig{} : snapkv, steps + 1);
        ASSERT_TRUE(seq.ok()) << seq.status();
        if (b == 0) {
          auto sel = MakeDecodeSelector(hybrid, c, seq->cache->shape(), HeapKvAllocator());
          ASSERT_TRUE(sel.ok()) << sel.status();
          selectors.push_back(std::move(*sel));
        }
        set->push_back(std::move(*seq));
      }
    }
    std::vector<int32_t> tokens(batch, 7);
    std::vector<int32_t> positions = {40, 49, 58};
    const kernels::KernelBackend::GraphCounts start = dev->backend()->graph_counts();
    for (int s = 0; s < steps; ++s) {
      // The third sequence leaves after four steps, and the batch of two is a graph of its own.
      const int n = s < 4 ? batch : 2;
      std::vector<kernels::SampleRow> rows(n);
      for (int b = 0; b < n; ++b) {
        rows[b].params.temperature = 0.8f;
        rows[b].uniform = 0.1 + 0.25 * b;
      }
      std::vector<kernels::SampledToken> got(n), want(n);
      for (bool graphs : {true, false}) {
        dev->SetDecodeGraphs(graphs);
        std::vector<DecodeInput> in;
        for (int b = 0; b < n; ++b) {
          DecodeSelector* selector = b == 0 ? selectors[graphs ? 0 : 1].get() : nullptr;
          in.push_back(
              {tokens[b], positions[b] + s, (graphs ? graphed : eager)[b].cache.get(), selector});
        }
        const auto before = dev->copy_counts();
        const absl::Status st = dev->DecodeStepSampled(in, rows, (graphs ? got : want).data());
        ASSERT_TRUE(st.ok()) << st;
        EXPECT_EQ((dev->copy_counts() - before).to_host_calls, 1) << "step " << s;
      }
      for (int b = 0; b < n; ++b) {
        ASSERT_EQ(got[b].id, want[b].id) << "step " << s << " sequence " << b;
        EXPECT_NEAR(got[b].logprob, want[b].logprob, 1e-4) << "step " << s << " sequence " << b;
        tokens[b] = got[b].id;
      }
    }
    const kernels::KernelBackend::GraphCounts counts = dev->backend()->graph_counts();
    EXPECT_EQ(counts.launched - start.launched, steps);
    if (device() == kernels::BackendKind::kGuarded) {
      // cuda makes a graph anew where an update cannot apply; the guarded backend never does.
      EXPECT_EQ(counts.made - start.made, 2);
      EXPECT_EQ(counts.updated - start.updated, steps - 2);
    } else {
      EXPECT_GE(counts.made - start.made, 2);
    }
    // The logits of a step as a graph equal those op by op too.
    dev->SetDecodeGraphs(true);
    std::vector<float> got(c.vocab_size), want(c.vocab_size);
    DecodeInput a{tokens[1], positions[1] + steps, graphed[1].cache.get(), nullptr};
    absl::Status st = dev->DecodeStep({&a, 1}, got.data());
    ASSERT_TRUE(st.ok()) << st;
    dev->SetDecodeGraphs(false);
    DecodeInput b{tokens[1], positions[1] + steps, eager[1].cache.get(), nullptr};
    st = dev->DecodeStep({&b, 1}, want.data());
    ASSERT_TRUE(st.ok()) << st;
    for (int v = 0; v < c.vocab_size; ++v) ASSERT_NEAR(got[v], want[v], 1e-4) << v;
    EXPECT_FALSE(dev->decode_graphs());
  }
}

// A step whose graph fails (it ran nothing) runs again op by op, its caches' lengths put back
// and its sparse selector told: the tokens are those of a model that never recorded a graph.
// After three such steps in a row (not after one, nor two) the model steps op by op.
TEST_P(DeviceEngine, AFailedGraphLeavesTheStepToRunOpByOp) {
  if (device() != kernels::BackendKind::kGuarded) {
    GTEST_SKIP() << "the failure is injected into the guarded backend's emulation";
  }
  auto dev = Load("synthetic:tiny,layers=3", On(device()));
  ASSERT_NE(dev, nullptr);
  const ModelConfig& c = dev->config();
  const DecodeAttentionConfig hybrid = Hybrid(16);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 60; ++i) prompt.push_back(3 + (i * 29) % (c.vocab_size - 3));
  const int steps = 8;
  // Each sequence twice (one stepped with graphs, one without), the first one sparse.
  std::vector<PrefilledSequence> seqs;
  std::vector<std::unique_ptr<DecodeSelector>> selectors;
  for (int i = 0; i < 4; ++i) {
    auto seq = PrefillSequence(*dev, prompt, CompressionConfig{}, steps + 1);
    ASSERT_TRUE(seq.ok()) << seq.status();
    auto sel = MakeDecodeSelector(hybrid, c, seq->cache->shape(), HeapKvAllocator());
    ASSERT_TRUE(sel.ok()) << sel.status();
    selectors.push_back(std::move(*sel));
    seqs.push_back(std::move(seq.value()));
  }
  std::vector<int32_t> tokens = {7, 9};
  for (int s = 0; s < steps; ++s) {
    if (s == 2 || s >= 4) kernels::FailNextGraphForTest(*dev->backend());
    std::vector<kernels::SampledToken> out[2];
    for (int copy : {0, 1}) {
      dev->SetDecodeGraphs(copy == 0);
      std::vector<DecodeInput> in;
      for (int b = 0; b < 2; ++b) {
        const int i = 2 * b + copy;
        in.push_back(
            {tokens[b], 60 + s, seqs[i].cache.get(), b == 0 ? selectors[i].get() : nullptr});
      }
      out[copy].resize(2);
      const absl::Status st =
          dev->DecodeStepSampled(in, std::vector<kernels::SampleRow>(2), out[copy].data());
      ASSERT_TRUE(st.ok()) << "step " << s << ": " << st;
    }
    for (int b = 0; b < 2; ++b) {
      ASSERT_EQ(out[0][b].id, out[1][b].id) << "step " << s << " sequence " << b;
      EXPECT_EQ(out[0][b].logprob, out[1][b].logprob) << "step " << s << " sequence " << b;
      EXPECT_EQ(seqs[2 * b].cache->layer(1).len, seqs[2 * b + 1].cache->layer(1).len);
      tokens[b] = out[0][b].id;
    }
    dev->SetDecodeGraphs(true);
    EXPECT_EQ(dev->decode_graphs(), s < 6) << "step " << s;
  }
}

// A selector told that its step never ran (StepUndone) plans its page summaries' update from
// the first token again, where it would otherwise take them as up to date.
TEST_P(DeviceEngine, AnUndoneStepRebuildsTheSelectorsSummaries) {
  auto dev = Load("synthetic:tiny,layers=3", On(device()));
  ASSERT_NE(dev, nullptr);
  const ModelConfig& c = dev->config();
  std::vector<int32_t> prompt;
  for (int i = 0; i < 60; ++i) prompt.push_back(3 + (i * 29) % (c.vocab_size - 3));
  auto seq = PrefillSequence(*dev, prompt, CompressionConfig{}, 4);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const DecodeAttentionConfig hybrid = Hybrid(16);
  auto sel = MakeDecodeSelector(hybrid, c, seq->cache->shape(), HeapKvAllocator());
  ASSERT_TRUE(sel.ok()) << sel.status();
  auto q = dev->backend()->Allocate(sizeof(float) * c.num_heads * c.head_dim);
  ASSERT_TRUE(q.ok());
  const LayerCache& lc = seq->cache->layer(1);
  auto plan = [&]() {
    int n = 0;
    EXPECT_TRUE((*sel)->Plan(1, lc, &n).value_or(false));
    BackendSelection out;
    EXPECT_TRUE(
        (*sel)->PlanOnBackend(dev->backend(), 1, lc, static_cast<const float*>(*q), &out).ok());
    return out.updates;
  };
  auto first = plan();
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].first, 0);
  EXPECT_EQ(first[0].len, lc.len);
  EXPECT_TRUE(plan().empty());  // up to date
  (*sel)->StepUndone();
  auto again = plan();
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].first, 0);
  EXPECT_EQ(again[0].len, lc.len);
  dev->backend()->Free(*q);
}

// Decode attention probabilities (a DecodeObserver, for fidelity measurements) are not returned
// by the device path: refused, naming the backend, and the refused step appends nothing. A
// cache decoded on the device is refused by a host model.
TEST_P(DeviceEngine, DecodeObserversAreRefusedSayingWhy) {
  auto dev = Load("synthetic:tiny", On(device()));
  ASSERT_NE(dev, nullptr);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
  auto seq = PrefillSequence(*dev, prompt, CompressionConfig{}, 4);
  ASSERT_TRUE(seq.ok()) << seq.status();
  struct Probe : DecodeObserver {
    void OnAttention(int, int, const float*, int) override {}
  } probe;
  std::vector<float> logits(dev->config().vocab_size);
  DecodeInput in{5, 8, seq->cache.get(), nullptr};
  const absl::Status st = dev->DecodeStep({&in, 1}, logits.data(), &probe);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
  EXPECT_NE(st.message().find(kernels::BackendName(device())), std::string::npos) << st;
  EXPECT_EQ(seq->cache->layer(0).len, 8);
  EXPECT_TRUE(dev->DecodeStep({&in, 1}, logits.data()).ok());
  EXPECT_EQ(seq->cache->layer(0).len, 9);
  // Its generated rows now live in the device copy: a host model refuses the cache rather than
  // attend over host rows nobody wrote.
  auto cpu = Load("synthetic:tiny", On(kernels::BackendKind::kCpu));
  ASSERT_NE(cpu, nullptr);
  DecodeInput next{6, 9, seq->cache.get(), nullptr};
  const absl::Status refused = cpu->DecodeStep({&next, 1}, logits.data());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("device"), std::string::npos) << refused;
}

// The agreement check at the 1B shape: 32 greedy steps on the GPU and the CPU engine, the same
// ids, or where bf16 rounding makes them part, teacher-forced top-1 agreement of at least 99%
// and a mean KL of at most 1e-3 over the generated positions.
TEST_P(DeviceEngine, Llama1bGreedyAgreesWithTheCpuEngine) {
  if (device() != kernels::BackendKind::kCuda) {
    GTEST_SKIP() << "the guarded backend runs the CPU kernels: the 1B shape is compared where "
                    "the GPU's kernels run";
  }
  const std::string spec = "synthetic:llama-1b";
  auto cpu = Load(spec, On(kernels::BackendKind::kCpu));
  auto gpu = Load(spec, On(device()));
  ASSERT_TRUE(cpu && gpu);
  std::vector<int32_t> prompt = {1};
  for (int i = 0; i < 63; ++i) prompt.push_back(300 + (i * 7919) % 20000);
  const int steps = 32;
  const auto a = Greedy(*cpu, prompt, steps);
  const auto b = Greedy(*gpu, prompt, steps);
  ASSERT_EQ(a.size(), static_cast<size_t>(steps));
  ASSERT_EQ(b.size(), static_cast<size_t>(steps));
  int same_prefix = 0;
  while (same_prefix < steps && a[same_prefix] == b[same_prefix]) ++same_prefix;
  // Teacher-forced over the CPU engine's continuation.
  std::vector<int32_t> ids = prompt;
  ids.insert(ids.end(), a.begin(), a.end());
  auto la = cpu->Prefill(ids, nullptr, true);
  auto lb = gpu->Prefill(ids, nullptr, true);
  ASSERT_TRUE(la.ok() && lb.ok());
  const int vocab = cpu->config().vocab_size;
  int agree = 0, n = 0;
  double kl_sum = 0;
  for (size_t pos = prompt.size() - 1; pos + 1 < ids.size(); ++pos, ++n) {
    const float* p = la->logits.data() + pos * vocab;
    const float* q = lb->logits.data() + pos * vocab;
    agree += std::max_element(p, p + vocab) - p == std::max_element(q, q + vocab) - q;
    const double mp = *std::max_element(p, p + vocab), mq = *std::max_element(q, q + vocab);
    double zp = 0, zq = 0;
    for (int v = 0; v < vocab; ++v) {
      zp += std::exp(p[v] - mp);
      zq += std::exp(q[v] - mq);
    }
    double kl = 0;
    for (int v = 0; v < vocab; ++v) {
      const double lp = p[v] - mp - std::log(zp), lq = q[v] - mq - std::log(zq);
      kl += std::exp(lp) * (lp - lq);
    }
    kl_sum += kl;
  }
  const double top1 = static_cast<double>(agree) / n, kl = kl_sum / n;
  std::printf(
      "llama-1b, %d greedy steps: ids equal for the first %d; teacher-forced top-1 "
      "agreement %.4f, mean KL %.3g\n",
      steps, same_prefix, top1, kl);
  if (same_prefix < steps) {
    EXPECT_GE(top1, 0.99);
    EXPECT_LE(kl, 1e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceEngine,
                         ::testing::Values(kernels::BackendKind::kGuarded,
                                           kernels::BackendKind::kCuda),
                         [](const auto& info) {
                           return std::string(kernels::BackendName(info.param));
                         });

}  // namespace
}  // namespace kvwire
