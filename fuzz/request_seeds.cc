// Writes the seeds of generate_request_fuzz and prefill_request_fuzz: serialized requests,
// most of them valid for the synthetic tiny model, covering the fields: text and id prompts,
// every compression policy with its parameters, every decode attention mode, sampling, stop
// strings and ids. Usage: request_seeds OUT_DIR (fuzz/make_seeds.py runs it with
// fuzz/corpus); it writes OUT_DIR/generate_request_fuzz/ and OUT_DIR/prefill_request_fuzz/.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/base/status.h"
#include "common/model/llama_model.h"
#include "kvwire/v1/generation.pb.h"
#include "kvwire/v1/prefill.pb.h"

namespace kvwire::fuzz {
namespace {

void Write(const std::filesystem::path& dir, const std::string& name,
           const google::protobuf::Message& msg) {
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary);
  KVWIRE_CHECK(msg.SerializeToOstream(&out));
}

v1::CompressionParams Policy(const std::string& name, int budget) {
  v1::CompressionParams p;
  p.set_policy(name);
  if (budget > 0) p.set_budget(budget);
  return p;
}

// One compression per policy and parameter, valid for the tiny model (2 layers) and the
// seeds' prompts (30-48 tokens, so that the targets prefill them).
std::vector<std::pair<std::string, v1::CompressionParams>> Compressions() {
  std::vector<std::pair<std::string, v1::CompressionParams>> out;
  out.emplace_back("full", Policy("full", 0));
  v1::CompressionParams p = Policy("streaming", 24);
  p.set_sinks(2);
  p.set_window(8);
  out.emplace_back("streaming", p);
  p = Policy("random", 0);
  p.set_ratio(0.5);
  p.set_seed(3);
  p.set_window(4);
  out.emplace_back("random_ratio", p);
  p = Policy("snapkv", 24);
  p.set_pool("avg");
  p.set_kernel(3);
  p.set_gqa("per_query_head");
  out.emplace_back("snapkv_per_query_head", p);
  p = Policy("snapkv", 20);
  p.set_pool("max");
  p.set_kernel(5);
  p.set_gqa("mean");
  p.set_window(8);
  p.set_skip_layers(1);
  out.emplace_back("snapkv_skip", p);
  p = Policy("snapkv_pp", 24);
  p.set_kernel_small(3);
  p.set_kernel_large(7);
  p.set_kernel_threshold(20);
  p.set_window(8);
  out.emplace_back("snapkv_pp", p);
  p = Policy("chunkkv", 30);
  p.set_chunk(4);
  p.set_reuse_layers(2);
  (*p.mutable_params())["chunk_scope"] = "per_kv_head";
  p.set_window(8);
  out.emplace_back("chunkkv", p);
  p = Policy("hbw", 32);
  p.set_block(2);
  p.add_groups(1);
  p.add_groups(4);
  p.set_gqa("max");
  p.set_window(8);
  out.emplace_back("hbw", p);
  p = Policy("rocketkv", 40);
  (*p.mutable_params())["budget_split"] = "sqrt";
  p.set_window(8);
  out.emplace_back("rocketkv_sqrt", p);
  p = Policy("rocketkv", 64);
  p.set_kernel_small(5);
  out.emplace_back("rocketkv", p);
  return out;
}

std::vector<int32_t> Ids(int n, int first) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(3 + (first + 37 * i) % 256);
  return ids;
}

void GenerateSeeds(const std::filesystem::path& dir) {
  const auto compressions = Compressions();
  int n = 0;
  for (const auto& [name, c] : compressions) {
    v1::GenerateRequest r;
    if (n % 2 == 0) {
      r.set_prompt("The quick brown fox jumps over the lazy dog.");
    } else {
      for (int32_t id : Ids(30 + n, n)) r.mutable_prompt_ids()->add_ids(id);
    }
    *r.mutable_compression() = c;
    r.mutable_sampling()->set_max_tokens(8 + n);
    Write(dir, "policy_" + name, r);
    ++n;
  }

  v1::GenerateRequest base;
  base.set_prompt("Once upon a time there lived a small fox.");
  base.mutable_sampling()->set_max_tokens(16);
  *base.mutable_compression() = Policy("snapkv", 24);

  v1::GenerateRequest r = base;
  r.set_request_id("req-0001");
  v1::SamplingParams* s = r.mutable_sampling();
  s->set_temperature(0.7f);
  s->set_top_p(0.9f);
  s->set_top_k(40);
  s->set_seed(12345);
  s->add_stop("\n\n");
  s->add_stop("fox");
  s->add_stop_token_ids(2);
  s->add_stop_token_ids(300);
  r.set_return_logprobs(true);
  Write(dir, "sampling_stop", r);

  r = base;
  r.mutable_sampling()->set_ignore_eos(true);
  r.mutable_sampling()->set_max_tokens(1);
  r.mutable_prompt_ids()->add_ids(5);  // the oneof: ids replace the text
  *r.mutable_compression() = Policy("full", 0);
  Write(dir, "one_token_ignore_eos", r);

  struct Attention {
    const char* name;
    const char* mode;
    int budget, k, r, page;
  };
  for (const Attention& a :
       {Attention{"dense", "dense", 0, 0, 0, 0}, Attention{"hybrid_budget", "hybrid", 16, 0, 0, 0},
        Attention{"hybrid_explicit", "hybrid", 0, 8, 4, 4}, Attention{"quest", "quest", 0, 8, 0, 2},
        Attention{"exact_topk", "exact_topk", 12, 0, 0, 0}}) {
    r = base;
    v1::DecodeAttentionParams* ap = r.mutable_attention();
    ap->set_mode(a.mode);
    if (a.budget) ap->set_token_budget(a.budget);
    if (a.k) ap->set_top_k(a.k);
    if (a.r) ap->set_top_r(a.r);
    if (a.page) ap->set_page_size(a.page);
    Write(dir, std::string("attention_") + a.name, r);
  }

  // Refused ones, for the error paths: contradictions and bounds.
  r = base;
  r.mutable_compression()->set_ratio(0.5);  // and a budget
  Write(dir, "refused_budget_and_ratio", r);
  r = base;
  *r.mutable_compression() = Policy("rocketkv", 48);
  r.mutable_attention()->set_mode("quest");
  Write(dir, "refused_rocketkv_attention", r);
  r = base;
  r.mutable_compression()->set_skip_layers(2);
  Write(dir, "refused_skip_layers", r);
  r = base;
  r.mutable_attention()->set_mode("hybrid");
  r.mutable_attention()->set_token_budget(16);
  r.mutable_attention()->set_top_r(17);
  Write(dir, "refused_top_r", r);
  r = base;
  for (int i = 0; i < 65; ++i) r.mutable_sampling()->add_stop_token_ids(i);
  Write(dir, "refused_stop_ids", r);
  r = base;
  (*r.mutable_compression()->mutable_params())["kernel"] = "9";
  r.mutable_compression()->set_policy("streaming");
  Write(dir, "refused_param", r);
}

void PrefillSeeds(const std::filesystem::path& dir, const std::string& fingerprint) {
  int n = 0;
  for (const auto& [name, c] : Compressions()) {
    if (c.policy() == "rocketkv") continue;  // the decode node resolves it (a refused seed below)
    v1::PrefillRequest r;
    r.set_request_id("prefill-" + name);
    for (int32_t id : Ids(24 + 3 * n, n)) r.add_prompt_ids(id);
    *r.mutable_compression() = c;
    r.set_model_fingerprint(fingerprint);
    r.set_max_chunk_bytes(n % 2 ? 1024 : 0);
    Write(dir, "policy_" + name, r);
    ++n;
  }
  v1::PrefillRequest r;
  r.set_request_id("sampled");
  for (int32_t id : Ids(32, 1)) r.add_prompt_ids(id);
  *r.mutable_compression() = Policy("snapkv", 24);
  r.set_model_fingerprint(fingerprint);
  r.set_max_chunk_bytes(4096);
  r.set_temperature(0.8f);
  r.set_top_p(0.95f);
  r.set_top_k(20);
  r.set_seed(99);
  Write(dir, "sampling", r);
  r.set_model_fingerprint("llama-16x2048-other");
  Write(dir, "refused_fingerprint", r);
  r.set_model_fingerprint(fingerprint);
  *r.mutable_compression() = Policy("rocketkv", 40);
  Write(dir, "refused_rocketkv", r);
  r.clear_prompt_ids();
  for (int32_t id : Ids(200, 5)) r.add_prompt_ids(id);
  *r.mutable_compression() = Policy("chunkkv", 64);
  Write(dir, "long_prompt", r);
}

}  // namespace
}  // namespace kvwire::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: request_seeds OUT_DIR\n");
    return 2;
  }
  auto model = kvwire::LlamaModel::Load("synthetic:tiny");
  KVWIRE_CHECK(model.ok());
  const std::filesystem::path out = argv[1];
  kvwire::fuzz::GenerateSeeds(out / "generate_request_fuzz");
  kvwire::fuzz::PrefillSeeds(out / "prefill_request_fuzz", (*model)->fingerprint());
  return 0;
}
