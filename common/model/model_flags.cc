#include "common/model/model_flags.h"

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire {

void DefineModelFlags(Flags& flags) {
  flags.Define("model", "",
               "Hugging Face model folder (config.json, *.safetensors, tokenizer.json) or "
               "synthetic:NAME (synthetic:tiny, synthetic:stories, synthetic:llama-1b, "
               "synthetic:llama-8b, synthetic:attn-8kv)");
  flags.Define("dtype", "", "convert weights to f32, bf16 or f16 at load (default: as stored)");
  flags.Define("threads", "0", "CPU threads (0: all cores)");
  flags.Define("weights", "copy",
               "where the kernels read the weights: copy (into the backend's memory at load; on "
               "the host backends, huge pages) or mapped (host backends only: the model files' "
               "mapping, shared through the page cache; loads faster, decodes slower)");
  flags.Define("backend", "cpu",
               "kernel backend of the engine: cpu, reference, cuda (a GPU build on a machine "
               "with an NVIDIA GPU: weights, activations and KV caches in device memory) or "
               "guarded (the cpu kernels on memory only ops may touch: the device path without "
               "a GPU, for tests)");
  flags.Define("decode-graphs", "on",
               "on: a device backend (cuda; guarded, which emulates it) runs each decode step as "
               "one CUDA graph; off: op by op (vLLM's --enforce-eager). Given with a host backend "
               "(cpu, reference), which runs ops as called, it is refused");
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
  const std::string weights = flags.GetString("weights");
  if (weights != "copy" && weights != "mapped") {
    return absl::InvalidArgumentError(
        absl::StrCat("--weights: expected copy or mapped, got '", weights, "'"));
  }
  options.mapped_weights = weights == "mapped";
  const std::string graphs = flags.GetString("decode-graphs");
  if (graphs != "on" && graphs != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--decode-graphs: expected on or off, got '", graphs, "'"));
  }
  if (flags.IsSet("decode-graphs") && (options.backend == kernels::BackendKind::kCpu ||
                                       options.backend == kernels::BackendKind::kReference)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--decode-graphs applies to a device backend (cuda, guarded); the ",
        kernels::BackendName(options.backend), " backend runs each op as it is called"));
  }
  options.decode_graphs = graphs == "on";
  return options;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LoadModelFromFlags(const Flags& flags) {
  ASSIGN_OR_RETURN(LoadOptions options, LoadOptionsFromFlags(flags));
  return LlamaModel::Load(flags.GetString("model"), options);
}

}  // namespace kvwire
