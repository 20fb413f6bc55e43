#include "common/engine/standard_flags.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {

void DefineModelFlags(Flags& flags) {
  flags.Define("model", "",
               "Hugging Face model folder (config.json, *.safetensors, tokenizer.json) or "
               "synthetic:NAME (synthetic:tiny, synthetic:stories, synthetic:llama-1b, "
               "synthetic:attn-8kv)");
  flags.Define("dtype", "", "convert weights to f32, bf16 or f16 at load (default: as stored)");
  flags.Define("threads", "0", "CPU threads (0: all cores)");
  flags.Define("backend", "cpu", "kernel backend of the engine: cpu or reference");
}

absl::StatusOr<LoadOptions> LoadOptionsFromFlags(const Flags& flags) {
  if (flags.GetString("model").empty()) return absl::InvalidArgumentError("--model is required");
  LoadOptions options;
  if (!flags.GetString("dtype").empty()) {
    ASSIGN_OR_RETURN(options.weight_dtype, ParseDType(flags.GetString("dtype")));
  }
  ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("threads", 0, 1024));
  options.threads = static_cast<int>(threads);
  ASSIGN_OR_RETURN(options.backend, kernels::ParseBackendKind(flags.GetString("backend")));
  if (options.backend == kernels::BackendKind::kCuda) {
    return absl::UnimplementedError(
        "--backend=cuda: the Llama engine runs on the cpu (or reference) backend in this "
        "version; the CUDA backend provides the kernels, not yet a device-resident model");
  }
  return options;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LoadModelFromFlags(const Flags& flags) {
  ASSIGN_OR_RETURN(LoadOptions options, LoadOptionsFromFlags(flags));
  return LlamaModel::Load(flags.GetString("model"), options);
}

void DefineCompressionFlags(Flags& flags) {
  flags.Define("policy", "full", "KV compression policy: " + PolicyNames());
  flags.Define("budget", "0", "tokens kept per KV head, observation window included");
  flags.Define("ratio", "0", "alternative to --budget: kept / prompt tokens, in (0, 1]");
  flags.Define("window", "16", "observation window: last prompt tokens that score (always kept)");
  flags.Define("kernel", "7", "snapkv pooling kernel (odd; 1 = no pooling)");
  flags.Define("pool", "max", "snapkv pooling: max or avg");
  flags.Define("gqa", "sum",
               "snapkv/hbw under GQA: per_query_head (original SnapKV), or per KV head with the "
               "group's votes combined by sum, mean or max");
  flags.Define("kernel-small", "63", "snapkv_pp kernel below --kernel-threshold prompt tokens");
  flags.Define("kernel-large", "511", "snapkv_pp kernel from --kernel-threshold prompt tokens on");
  flags.Define("kernel-threshold", "49152", "snapkv_pp prompt length that switches kernels");
  flags.Define("chunk", "10", "chunkkv chunk size");
  flags.Define("reuse-layers", "1", "chunkkv layer-wise index reuse group size (1: none)");
  flags.Define("block", "0", "hbw block size (0: budget / 32)");
  flags.Define("groups", "1,8", "hbw hierarchical rounds: group counts M per round");
  flags.Define("sinks", "4", "streaming attention sinks");
  flags.Define("skip-layers", "0", "first layers kept dense (uncompressed)");
  if (!flags.IsDefined("seed")) flags.Define("seed", "0", "seed of the random policy");
}

absl::StatusOr<CompressionConfig> CompressionFromFlags(const Flags& flags) {
  CompressionConfig c;
  ASSIGN_OR_RETURN(c.policy, ParsePolicy(flags.GetString("policy")));
  ASSIGN_OR_RETURN(int64_t budget, flags.GetInt("budget", 0, 1 << 30));
  c.budget = static_cast<int>(budget);
  ASSIGN_OR_RETURN(c.ratio, flags.GetDouble("ratio", 0, 1));
  ASSIGN_OR_RETURN(int64_t window, flags.GetInt("window", 1, 1 << 20));
  c.window = static_cast<int>(window);
  ASSIGN_OR_RETURN(int64_t kernel, flags.GetInt("kernel", 1, 1 << 20));
  c.kernel = static_cast<int>(kernel);
  ASSIGN_OR_RETURN(c.pool, ParsePool(flags.GetString("pool")));
  ASSIGN_OR_RETURN(c.gqa, ParseGqa(flags.GetString("gqa")));
  ASSIGN_OR_RETURN(int64_t ks, flags.GetInt("kernel-small", 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t kl, flags.GetInt("kernel-large", 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t kt, flags.GetInt("kernel-threshold", 1, 1 << 30));
  c.kernel_small = static_cast<int>(ks);
  c.kernel_large = static_cast<int>(kl);
  c.kernel_threshold = static_cast<int>(kt);
  ASSIGN_OR_RETURN(int64_t chunk, flags.GetInt("chunk", 1, 1 << 20));
  c.chunk = static_cast<int>(chunk);
  ASSIGN_OR_RETURN(int64_t reuse, flags.GetInt("reuse-layers", 1, 1 << 20));
  c.reuse_layers = static_cast<int>(reuse);
  ASSIGN_OR_RETURN(int64_t block, flags.GetInt("block", 0, 1 << 20));
  c.block = static_cast<int>(block);
  c.groups.clear();
  for (const std::string& g : flags.GetList("groups")) {
    int v = 0;
    if (!absl::SimpleAtoi(g, &v) || v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--groups must be a comma-separated list of positive integers, got '",
                       flags.GetString("groups"), "'"));
    }
    c.groups.push_back(v);
  }
  ASSIGN_OR_RETURN(int64_t sinks, flags.GetInt("sinks", 0, 1 << 20));
  c.sinks = static_cast<int>(sinks);
  ASSIGN_OR_RETURN(int64_t skip, flags.GetInt("skip-layers", 0, 1 << 10));
  c.skip_layers = static_cast<int>(skip);
  ASSIGN_OR_RETURN(int64_t seed, flags.GetInt("seed", 0, INT64_MAX));
  c.seed = static_cast<uint64_t>(seed);
  RETURN_IF_ERROR(c.Validate());
  return c;
}

void DefineAttentionFlags(Flags& flags) {
  flags.Define("attention", "dense", "decode attention: dense, hybrid, quest or exact_topk");
  flags.Define("attention-budget", "0",
               "per-step token budget of sparse attention, per KV head, auxiliary reads included");
  flags.Define("attention-k", "0", "tokens attended per KV head (overrides the budget's)");
  flags.Define("attention-r", "0", "hybrid: head dimensions approximated (overrides)");
  flags.Define("attention-page", "0", "tokens per page summary (overrides)");
}

absl::StatusOr<DecodeAttentionConfig> AttentionFromFlags(const Flags& flags) {
  DecodeAttentionConfig a;
  ASSIGN_OR_RETURN(a.mode, ParseAttentionMode(flags.GetString("attention")));
  ASSIGN_OR_RETURN(int64_t t, flags.GetInt("attention-budget", 0, 1 << 30));
  ASSIGN_OR_RETURN(int64_t k, flags.GetInt("attention-k", 0, 1 << 30));
  ASSIGN_OR_RETURN(int64_t r, flags.GetInt("attention-r", 0, 1 << 20));
  ASSIGN_OR_RETURN(int64_t p, flags.GetInt("attention-page", 0, 1 << 20));
  a.token_budget = static_cast<int>(t);
  a.top_k = static_cast<int>(k);
  a.top_r = static_cast<int>(r);
  a.page_size = static_cast<int>(p);
  RETURN_IF_ERROR(a.Validate());
  return a;
}

}  // namespace kvwire
