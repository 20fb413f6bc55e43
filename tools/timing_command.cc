// kvwire timing: prefill and decode wall times of greedy generation from given token ids, as
// JSON, for benchmarks that drive kvwire and another engine on the same ids (bench/peers).
// No tokenizer is involved: the ids go to the model as they are.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "common/base/status.h"
#include "tools/commands.h"
#include "tools/timing.h"

namespace kvwire::tools {

int RunTiming(int argc, char** argv) {
  Flags flags;
  DefineModelFlags(flags);
  DefineCompressionFlags(flags);
  DefineKvFormatFlag(flags);
  DefineAttentionFlags(flags);
  flags.Define("prompt-ids", "", "the prompt as comma-separated token ids (no BOS is added)");
  flags.Define("decode", "64", "greedy decode steps after the prefill (0: prefill only)");
  flags.Define("runs", "1", "timed runs, one after another in this process");
  flags.DefineBool("no-warmup",
                   "skip the untimed warm-up (a short prefill and one decode step that page "
                   "the weights in) before the timed runs");
  const char* usage =
      "kvwire timing --model DIR --prompt-ids ID,ID,... [--decode N] [--runs N] [--threads N] "
      "[--backend NAME] [--policy NAME --budget N ...] [--attention MODE ...]";
  if (int rc = ParseFlagsOrExit(flags, "kvwire timing", usage, argc, argv, 0); rc >= 0) return rc;
  auto decode = flags.GetInt("decode", 0, 1 << 20);
  if (!decode.ok()) return Fail("timing", decode.status());
  auto runs = flags.GetInt("runs", 1, 1000);
  if (!runs.ok()) return Fail("timing", runs.status());
  if (flags.GetString("prompt-ids").empty()) {
    return Fail("timing", absl::InvalidArgumentError("--prompt-ids is required"));
  }
  auto options = LoadOptionsFromFlags(flags);  // flag errors before the model loads
  if (!options.ok()) return Fail("timing", options.status());
  CompressionConfig compression;
  DecodeAttentionConfig attention;
  if (absl::Status st = CompressionAndAttentionFromFlags(flags, {}, &compression, &attention);
      !st.ok()) {
    return Fail("timing", st);
  }
  auto model = LoadModelFromFlags(flags);
  if (!model.ok()) return Fail("timing", model.status());
  auto prompt = ParseTokenIds(flags.GetString("prompt-ids"), (*model)->config().vocab_size);
  if (!prompt.ok()) return Fail("timing", Annotate(prompt.status(), "--prompt-ids"));
  const int steps = static_cast<int>(*decode);

  if (!flags.GetBool("no-warmup")) {
    // Touches every weight (a memory-mapped file is paged in on first use) without the
    // cost of a long prompt.
    const size_t n = std::min<size_t>(prompt->size(), 8);
    auto warm = TimeGreedyGeneration(**model, absl::MakeConstSpan(prompt->data(), n), 1,
                                     CompressionConfig{}, DecodeAttentionConfig{});
    if (!warm.ok()) return Fail("timing", warm.status());
  }
  nlohmann::json out = {{"model", (*model)->description()},
                        {"backend", kernels::BackendName(options->backend)},
                        {"threads", options->threads},
                        {"prompt_tokens", prompt->size()},
                        {"decode_steps", steps},
                        {"compression", compression.Describe()},
                        {"attention", attention.Describe()},
                        {"runs", nlohmann::json::array()}};
  TimedGeneration last;
  for (int64_t i = 0; i < *runs; ++i) {
    auto r = TimeGreedyGeneration(**model, *prompt, steps, compression, attention);
    if (!r.ok()) return Fail("timing", r.status());
    std::fprintf(stderr, "run %lld: prefill %zu tokens %.1f ms (%.1f tok/s)",
                 static_cast<long long>(i), prompt->size(), r->prefill_seconds * 1e3,
                 prompt->size() / std::max(r->prefill_seconds, 1e-9));
    if (steps > 0) {
      std::fprintf(stderr, ", decode %d steps %.1f ms (%.1f tok/s)", steps, r->decode_seconds * 1e3,
                   steps / std::max(r->decode_seconds, 1e-9));
    }
    std::fprintf(stderr, "\n");
    out["runs"].push_back({{"prefill_seconds", r->prefill_seconds},
                           {"decode_seconds", r->decode_seconds},
                           {"ids", r->ids}});
    last = *std::move(r);
  }
  // What crossed between the host and the backend's memory (the last run): the prefill's, and
  // a decode step's as the mean over the steps. On a GPU, what crossed PCIe.
  auto counts = [](const kernels::KernelBackend::CopyCounts& c, double per) {
    return nlohmann::json{{"to_host_bytes", c.to_host_bytes / per},
                          {"to_device_bytes", c.to_device_bytes / per},
                          {"calls", (c.to_host_calls + c.to_device_calls) / per},
                          {"to_host_calls", c.to_host_calls / per},
                          {"to_device_calls", c.to_device_calls / per}};
  };
  out["copies"] = {{"prefill", counts(last.prefill_copies, 1)}};
  if (steps > 0) out["copies"]["decode_step"] = counts(last.decode_copies, steps);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace kvwire::tools
