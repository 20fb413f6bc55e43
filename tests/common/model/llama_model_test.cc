// The engine against ../shared/models/stories260K-hf/REFERENCE.json, which an independent
// implementation computed: greedy ids token for token, teacher-forced NLL within 1e-3,
// and in BF16 the first 32 greedy tokens. Plus the engine's own invariants: decode steps
// reproduce prefill logits, batching changes nothing, the reference and CPU backends
// agree, and every malformed model folder is an error naming the file and the problem.
#include "common/model/llama_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/flags.h"
#include "common/engine/generate.h"
#include "common/model/model_flags.h"
#include "common/model/safetensors.h"
#include "tests/engine_fakes.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

using testing::Greedy;
using testing::SumNll;

using nlohmann::json;
namespace fs = std::filesystem;

json Reference() {
  return json::parse(testing::ReadFile(testing::StoriesModelDir() + "/REFERENCE.json"));
}

std::unique_ptr<LlamaModel> LoadStories(LoadOptions options = {}) {
  auto m = LlamaModel::Load(testing::StoriesModelDir(), options);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

std::vector<int32_t> Ids(const json& j) { return j.get<std::vector<int32_t>>(); }

// A request that says nothing about sampling is greedy: the same tokens whatever the seed,
// the reference's greedy tokens.
TEST(StoriesReference, DefaultSamplingIsGreedy) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  const json ref = Reference()["greedy_from_bos"];
  for (uint64_t seed : {0, 1, 12345}) {
    GenerationRequest req;
    req.prompt_ids = Ids(ref["prompt_ids"]);
    req.max_tokens = ref["max_new_tokens"].get<int>();
    req.seed = seed;
    auto r = Generate(*model, req);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->ids, Ids(ref["ids"])) << "seed " << seed;
  }
}

TEST(StoriesReference, GreedyFromBosMatchesExactly) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  const json ref = Reference()["greedy_from_bos"];
  EXPECT_EQ(Greedy(*model, Ids(ref["prompt_ids"]), ref["max_new_tokens"].get<int>()),
            Ids(ref["ids"]));
}

TEST(StoriesReference, GreedyFromPromptMatchesExactly) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  const json ref = Reference()["greedy_from_prompt"];
  auto ids = model->tokenizer().Encode(ref["prompt"].get<std::string>());
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, Ids(ref["prompt_ids"]));
  const auto got = Greedy(*model, *ids, ref["max_new_tokens"].get<int>());
  EXPECT_EQ(got, Ids(ref["ids"]));
  auto text = model->tokenizer().Decode(got);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, ref["text"].get<std::string>());
}

TEST(StoriesReference, TeacherForcedNllWithin1e3) {
  KVWIRE_REQUIRE_SHARED();
  auto model = LoadStories();
  ASSERT_NE(model, nullptr);
  const json ref = Reference()["teacher_forced"];
  const auto ids = Ids(ref["ids"]);
  auto enc = model->tokenizer().Encode(ref["text"].get<std::string>());
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(*enc, ids);
  EXPECT_NEAR(SumNll(*model, ids), ref["sum_nll"].get<double>(), 1e-3);
}

TEST(StoriesReference, Bf16GreedyFirst32Identical) {
  KVWIRE_REQUIRE_SHARED();
  LoadOptions opts;
  opts.weight_dtype = DType::kBF16;
  auto model = LoadStories(opts);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->weight_dtype(), DType::kBF16);
  EXPECT_EQ(model->kv_dtype(), DType::kBF16);
  const json ref = Reference();
  for (const char* run : {"greedy_from_bos", "greedy_from_prompt"}) {
    const auto want = Ids(ref[run]["ids"]);
    const auto got = Greedy(*model, Ids(ref[run]["prompt_ids"]), 32);
    EXPECT_EQ(got, std::vector<int32_t>(want.begin(), want.begin() + 32)) << run;
  }
}

// Decoding token by token must give the logits a prefill of the whole sequence gives.
TEST(Engine, DecodeStepsReproducePrefillLogits) {
  for (const std::string& spec : {std::string("synthetic:tiny"), testing::StoriesModelDir()}) {
    if (spec.empty()) continue;
    SCOPED_TRACE(spec);
    auto model_or = LlamaModel::Load(spec);
    ASSERT_TRUE(model_or.ok()) << model_or.status();
    LlamaModel& m = **model_or;
    const ModelConfig& c = m.config();
    std::vector<int32_t> ids;
    for (int i = 0; i < 40; ++i) ids.push_back(3 + (i * 37) % (c.vocab_size - 3));
    auto full = m.Prefill(ids, nullptr, true);
    ASSERT_TRUE(full.ok());
    const int p = 25;
    auto seq = PrefillSequence(m, absl::MakeConstSpan(ids).subspan(0, p), CompressionConfig{}, 64);
    ASSERT_TRUE(seq.ok()) << seq.status();
    std::vector<float> logits(c.vocab_size);
    for (int i = p; i < 40; ++i) {
      DecodeInput in{ids[i], i, seq->cache.get(), nullptr};
      ASSERT_TRUE(m.DecodeStep({&in, 1}, logits.data()).ok());
      for (int v = 0; v < c.vocab_size; ++v) {
        ASSERT_NEAR(logits[v], full->logits[int64_t{i} * c.vocab_size + v], 2e-4)
            << "position " << i << " token " << v;
      }
    }
  }
}

TEST(Engine, BatchedDecodeEqualsOneByOne) {
  auto model_or = LlamaModel::Load("synthetic:tiny");
  ASSERT_TRUE(model_or.ok());
  LlamaModel& m = **model_or;
  const ModelConfig& c = m.config();
  const std::vector<std::vector<int32_t>> prompts = {{1, 50, 60}, {1, 7, 8, 9, 10, 11, 12}, {1}};
  std::vector<std::unique_ptr<KvCache>> solo, batched;
  for (int copy = 0; copy < 2; ++copy) {
    for (const auto& p : prompts) {
      auto seq = PrefillSequence(m, p, CompressionConfig{}, 32);
      ASSERT_TRUE(seq.ok()) << seq.status();
      (copy == 0 ? solo : batched).push_back(std::move(seq->cache));
    }
  }
  std::vector<float> one(c.vocab_size), all(3 * c.vocab_size);
  for (int step = 0; step < 5; ++step) {
    std::vector<DecodeInput> ins;
    for (int b = 0; b < 3; ++b) {
      const int pos = static_cast<int>(prompts[b].size()) + step;
      ins.push_back({100 + b + step, pos, batched[b].get(), nullptr});
    }
    ASSERT_TRUE(m.DecodeStep(ins, all.data()).ok());
    for (int b = 0; b < 3; ++b) {
      DecodeInput in = ins[b];
      in.cache = solo[b].get();
      ASSERT_TRUE(m.DecodeStep({&in, 1}, one.data()).ok());
      for (int v = 0; v < c.vocab_size; ++v) {
        ASSERT_NEAR(all[b * c.vocab_size + v], one[v], 1e-5) << "seq " << b << " step " << step;
      }
    }
  }
}

TEST(Engine, ReferenceBackendAgreesWithCpuBackend) {
  KVWIRE_REQUIRE_SHARED();
  LoadOptions ref_opts;
  ref_opts.backend = kernels::BackendKind::kReference;
  auto ref = LoadStories(ref_opts);
  auto cpu = LoadStories();
  ASSERT_NE(ref, nullptr);
  const std::vector<int32_t> ids = Ids(Reference()["teacher_forced"]["ids"]);
  auto a = ref->Prefill(ids, nullptr, true);
  auto b = cpu->Prefill(ids, nullptr, true);
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t i = 0; i < a->logits.size(); ++i) {
    ASSERT_NEAR(a->logits[i], b->logits[i], 1e-4 + 1e-4 * std::fabs(a->logits[i])) << i;
  }
}

// The kernels read the same weights whether copied at load (the default: q|k|v and gate|up
// placed as one matrix each) or read from the file's mapping (--weights mapped: each projection
// apart): the same logits to the bit, for a prompt of at most 64 rows (the products of few rows
// sum each output in one order however wide; wider f32 prompts go to OpenBLAS in other slices,
// BiasedProjectionsAreFusedWithTheirBiases). A device backend, whose kernels cannot read host
// memory, refuses the mapping, and the flag takes only its values.
TEST(Engine, MappedWeightsGiveTheSameLogits) {
  KVWIRE_REQUIRE_SHARED();
  LoadOptions mapped;
  mapped.mapped_weights = true;
  auto a = LoadStories();
  auto b = LoadStories(mapped);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> ids = Ids(Reference()["teacher_forced"]["ids"]);
  auto la = a->Prefill(ids, nullptr, true);
  auto lb = b->Prefill(ids, nullptr, true);
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_EQ(la->logits, lb->logits);

  mapped.backend = kernels::BackendKind::kGuarded;
  auto refused = LlamaModel::Load(testing::StoriesModelDir(), mapped);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("host backends"), std::string::npos)
      << refused.status();

  for (const auto& [value, ok] : {std::pair<const char*, bool>{"copy", true},
                                  {"mapped", true},
                                  {"mmap", false},
                                  {"Copy", false}}) {
    Flags flags;
    DefineModelFlags(flags);
    ASSERT_TRUE(flags.Parse({"--model", "synthetic:tiny", "--weights", value}).ok()) << value;
    auto options = LoadOptionsFromFlags(flags);
    EXPECT_EQ(options.ok(), ok) << value << ": " << options.status();
    if (ok) {
      EXPECT_EQ(options->mapped_weights, std::string(value) == "mapped");
    } else {
      EXPECT_NE(options.status().message().find("expected copy or mapped"), std::string::npos);
    }
  }
}

// --decode-graphs: on or off, for a device backend; refused naming the backend with a host one
// (which runs ops as called), and any other value refused saying what is expected.
TEST(Engine, DecodeGraphsFlagIsADeviceBackendsAndChecked) {
  struct Case {
    std::vector<std::string> args;
    bool ok;
    bool graphs;
    const char* error;
  };
  for (const Case& c : std::vector<Case>{
           {{}, true, true, ""},
           {{"--backend", "guarded", "--decode-graphs", "off"}, true, false, ""},
           {{"--backend", "guarded", "--decode-graphs", "on"}, true, true, ""},
           {{"--backend", "guarded", "--decode-graphs", "yes"}, false, false, "expected on or off"},
           {{"--decode-graphs", "off"}, false, false, "the cpu backend runs each op"},
           {{"--backend", "reference", "--decode-graphs", "on"},
            false,
            false,
            "the reference backend runs each op"}}) {
    Flags flags;
    DefineModelFlags(flags);
    std::vector<std::string> args = {"--model", "synthetic:tiny"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    ASSERT_TRUE(flags.Parse(args).ok());
    auto options = LoadOptionsFromFlags(flags);
    SCOPED_TRACE(absl::StrJoin(c.args, " "));
    ASSERT_EQ(options.ok(), c.ok) << options.status();
    if (c.ok) {
      EXPECT_EQ(options->decode_graphs, c.graphs);
    } else {
      EXPECT_NE(options.status().message().find(c.error), std::string::npos) << options.status();
    }
  }
}

TEST(Engine, SyntheticModelsAreDeterministic) {
  auto a = LlamaModel::Load("synthetic:tiny,seed=7");
  auto b = LlamaModel::Load("synthetic:tiny,seed=7");
  auto c = LlamaModel::Load("synthetic:tiny,seed=8");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const std::vector<int32_t> ids = {1, 72, 101, 108};
  auto la = (*a)->Prefill(ids, nullptr);
  auto lb = (*b)->Prefill(ids, nullptr);
  auto lc = (*c)->Prefill(ids, nullptr);
  EXPECT_EQ(la->logits, lb->logits);
  EXPECT_NE(la->logits, lc->logits);
  EXPECT_NE((*a)->description().find("synthetic"), std::string::npos);
}

// Loading fills a tensor's rows on several host threads; the weights do not depend on how
// many (each element is a function of its index), and llama-8b is a preset.
TEST(Engine, SyntheticWeightsDoNotDependOnTheThreads) {
  const std::string spec =
      "synthetic:tiny,layers=1,hidden=1024,heads=8,kv_heads=4,head_dim=128,ffn=4096";
  std::vector<std::vector<float>> logits;
  for (int threads : {1, 3}) {
    LoadOptions o;
    o.backend = kernels::BackendKind::kReference;
    o.threads = threads;
    auto m = LlamaModel::Load(spec, o);
    ASSERT_TRUE(m.ok()) << m.status();
    auto out = (*m)->Prefill(std::vector<int32_t>{1, 72, 101}, nullptr);
    ASSERT_TRUE(out.ok()) << out.status();
    logits.push_back(out->logits);
  }
  EXPECT_EQ(logits[0], logits[1]);
  EXPECT_NE(LlamaModel::SyntheticSpecHelp().find("llama-8b"), std::string::npos);
}

TEST(Engine, SyntheticSpecErrors) {
  for (const char* spec : {"synthetic:nope", "synthetic:tiny,layers=0", "synthetic:tiny,colour=red",
                           "synthetic:tiny,heads=3,kv_heads=2", "synthetic:tiny,dtype=f8"}) {
    auto m = LlamaModel::Load(spec);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << spec << ": " << m.status();
  }
}

TEST(Engine, RejectsBadInputs) {
  auto model_or = LlamaModel::Load("synthetic:tiny,context=64");
  ASSERT_TRUE(model_or.ok());
  LlamaModel& m = **model_or;
  EXPECT_EQ(m.Prefill({}, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Prefill(std::vector<int32_t>{1, 5000}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Prefill(std::vector<int32_t>(65, 5), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  GenerationRequest req;
  req.prompt_ids = std::vector<int32_t>(60, 5);
  req.max_tokens = 10;
  auto r = Generate(m, req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.status().message()).find("context"), std::string::npos);
}

// ------------------------------------------------------------ malformed model folders

class BrokenModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVWIRE_REQUIRE_SHARED();
    dir_ = testing::MakeTempDir("broken-model");
    for (const char* f : {"config.json", "tokenizer.json", "model.safetensors"}) {
      fs::copy_file(testing::StoriesModelDir() + "/" + f, dir_ + "/" + f);
    }
  }
  absl::Status Load() { return LlamaModel::Load(dir_).status(); }
  // Rewrites model.safetensors with `edit` applied to its tensors.
  void RewriteWeights(const std::function<void(std::vector<TensorToWrite>&)>& edit) {
    auto f = SafetensorsFile::Open(testing::StoriesModelDir() + "/model.safetensors");
    ASSERT_TRUE(f.ok());
    std::vector<TensorToWrite> ts;
    for (const auto& [name, v] : (*f)->tensors()) ts.push_back({name, v.dtype, v.shape, v.data});
    edit(ts);
    ASSERT_TRUE(WriteSafetensors(dir_ + "/model.safetensors", ts).ok());
  }
  std::string dir_;
};

void ExpectError(const absl::Status& st, absl::StatusCode code,
                 const std::vector<std::string>& fragments) {
  EXPECT_EQ(st.code(), code) << st;
  for (const auto& f : fragments) {
    EXPECT_NE(std::string(st.message()).find(f), std::string::npos)
        << "'" << f << "' not in: " << st.message();
  }
}

TEST_F(BrokenModelTest, LoadsWhenIntact) { EXPECT_TRUE(Load().ok()) << Load(); }

// A checkpoint with biases on every projection (attention_bias and mlp_bias): the fused q|k|v
// and gate|up carry each part's bias at its rows. The copied model (fused) gives the mapped
// one's logits (each projection apart), on a prompt of few rows and on one of many, and the
// biases change them.
TEST_F(BrokenModelTest, BiasedProjectionsAreFusedWithTheirBiases) {
  std::string cfg = testing::ReadFile(dir_ + "/config.json");
  cfg.replace(cfg.find('{'), 1, "{\"attention_bias\": true, \"mlp_bias\": true, ");
  testing::WriteFile(dir_ + "/config.json", cfg);
  const int hd = 64, qd = 64, kvd = 32, ffn = 172;  // stories260K
  std::vector<std::vector<float>> biases;
  RewriteWeights([&](auto& ts) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    const std::vector<std::pair<std::string, int>> parts = {
        {"self_attn.q_proj", qd}, {"self_attn.k_proj", kvd}, {"self_attn.v_proj", kvd},
        {"self_attn.o_proj", hd}, {"mlp.gate_proj", ffn},    {"mlp.up_proj", ffn},
        {"mlp.down_proj", hd}};
    for (int l = 0; l < 5; ++l) {
      for (const auto& [name, n] : parts) {
        biases.emplace_back(n);
        for (float& b : biases.back()) b = u(rng);
        ts.push_back({absl::StrCat("model.layers.", l, ".", name, ".bias"),
                      "F32",
                      {static_cast<int64_t>(n)},
                      biases.back().data()});
      }
    }
  });
  auto fused = LlamaModel::Load(dir_);
  ASSERT_TRUE(fused.ok()) << fused.status();
  LoadOptions mapped;
  mapped.mapped_weights = true;
  auto apart = LlamaModel::Load(dir_, mapped);
  ASSERT_TRUE(apart.ok()) << apart.status();
  auto plain = LlamaModel::Load(testing::StoriesModelDir());
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (int len : {20, 300}) {
    SCOPED_TRACE(absl::StrCat("len=", len));
    std::vector<int32_t> ids(len);
    for (int i = 0; i < len; ++i) ids[i] = 3 + (i * 37) % 500;
    auto a = (*fused)->Prefill(ids, nullptr, true);
    auto b = (*apart)->Prefill(ids, nullptr, true);
    auto c = (*plain)->Prefill(ids, nullptr, true);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    ASSERT_EQ(a->logits.size(), b->logits.size());
    double moved = 0;
    for (size_t i = 0; i < a->logits.size(); ++i) {
      ASSERT_NEAR(a->logits[i], b->logits[i], 1e-5 + 1e-5 * std::fabs(b->logits[i])) << i;
      moved = std::max(moved, std::fabs(double{a->logits[i]} - c->logits[i]));
    }
    if (len <= 64) {
      EXPECT_EQ(a->logits, b->logits);
    }
    EXPECT_GT(moved, 0.1);  // the biases were read
  }
}

TEST_F(BrokenModelTest, MissingTensor) {
  RewriteWeights([](auto& ts) {
    std::erase_if(ts, [](auto& t) { return t.name == "model.layers.2.mlp.up_proj.weight"; });
  });
  ExpectError(Load(), absl::StatusCode::kNotFound,
              {"model.layers.2.mlp.up_proj.weight", "model.safetensors"});
}

TEST_F(BrokenModelTest, ShapeDisagreesWithConfig) {
  std::vector<float> wrong(64 * 63);
  RewriteWeights([&](auto& ts) {
    for (auto& t : ts) {
      if (t.name == "model.layers.0.self_attn.q_proj.weight") {
        t.shape = {63, 64};
        t.data = wrong.data();
      }
    }
  });
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"model.layers.0.self_attn.q_proj.weight", "[63, 64]", "config.json", "[64, 64]"});
}

TEST_F(BrokenModelTest, TruncatedWeights) {
  const std::string bytes = testing::ReadFile(dir_ + "/model.safetensors");
  testing::WriteFile(dir_ + "/model.safetensors", bytes.substr(0, bytes.size() - 1000));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument, {"model.safetensors", "truncated"});
}

TEST_F(BrokenModelTest, LyingHeaderLength) {
  std::string bytes = testing::ReadFile(dir_ + "/model.safetensors");
  bytes[5] = 0x7f;
  testing::WriteFile(dir_ + "/model.safetensors", bytes);
  ExpectError(Load(), absl::StatusCode::kInvalidArgument, {"model.safetensors", "header length"});
}

TEST_F(BrokenModelTest, UnknownArchitecture) {
  std::string cfg = testing::ReadFile(dir_ + "/config.json");
  cfg.replace(cfg.find("\"llama\""), 7, "\"bloom\"");
  cfg.replace(cfg.find("LlamaForCausalLM"), 16, "BloomForCausalLM");
  testing::WriteFile(dir_ + "/config.json", cfg);
  ExpectError(Load(), absl::StatusCode::kUnimplemented, {"config.json", "bloom"});
}

TEST_F(BrokenModelTest, BrokenTokenizer) {
  testing::WriteFile(dir_ + "/tokenizer.json", "{\"model\": ");
  const absl::Status st = Load();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("tokenizer.json"), std::string::npos) << st;
}

TEST_F(BrokenModelTest, MissingFolder) {
  ExpectError(LlamaModel::Load(dir_ + "/nope").status(), absl::StatusCode::kNotFound,
              {"config.json"});
}

}  // namespace
}  // namespace kvwire
