// kvwire eval fidelity|passkey: compare compression policies on a dataset, with a
// progress bar, a table on stdout, --json records and a --plot PNG.
//
// Methods are policy names (rocketkv: both stages from one token budget) or decode
// attention modes over the full cache (hybrid, quest, exact_topk), optionally with
// parameter overrides after colons, e.g.
//   --policies snapkv,snapkv:gqa=per_query_head,hbw:groups=1,streaming,rocketkv,quest
// Overrides use the compression flags' names (see --help); the rest come from the flags.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "tools/commands.h"
#include "tools/eval.h"
#include "tools/plot.h"

namespace kvwire::tools {
namespace {

// Each method re-parses the command line's compression flags with its own overrides.
absl::StatusOr<std::vector<EvalMethod>> Methods(const std::vector<std::string>& names,
                                                const std::vector<std::string>& args) {
  std::vector<EvalMethod> methods;
  for (const std::string& spec : names) {
    std::vector<std::string> parts = absl::StrSplit(spec, ':');
    std::vector<std::string> margs = args;
    const bool is_mode = ParseAttentionMode(parts[0]).ok();
    margs.push_back("--policy=" + (is_mode ? std::string("full") : parts[0]));
    for (size_t i = 1; i < parts.size(); ++i) margs.push_back("--" + parts[i]);
    Flags f;
    DefineCompressionFlags(f);
    absl::Status st = f.Parse(margs);
    if (!st.ok()) return Annotate(st, absl::StrCat("method '", spec, "'"));
    // Validate once with a budget the checks accept, so errors surface before the run.
    f.Parse({"--budget=1000000"}).IgnoreError();
    auto probe = CompressionFromFlags(f);
    if (!probe.ok()) return Annotate(probe.status(), absl::StrCat("method '", spec, "'"));
    const CompressionConfig base = *probe;
    // A decode attention mode as the method: the full prompt cache, sparse reads of
    // `budget` tokens per step (RocketKV's comparison points).
    auto mode = ParseAttentionMode(parts[0]);
    if (mode.ok() && *mode != AttentionMode::kDense) {
      const AttentionMode m = *mode;
      methods.push_back({spec, [](int) { return CompressionConfig{}; }, [m](int budget) {
                           DecodeAttentionConfig a;
                           a.mode = m;
                           a.token_budget = budget;
                           return a;
                         }});
      continue;
    }
    methods.push_back({spec,
                       [base](int budget) {
                         CompressionConfig c = base;
                         c.budget = budget;
                         c.ratio = 0;
                         return c;
                       },
                       nullptr});
  }
  return methods;
}

absl::StatusOr<std::vector<int>> Budgets(const Flags& flags) {
  std::vector<int> out;
  for (const std::string& b : flags.GetList("budgets")) {
    int v = 0;
    if (!absl::SimpleAtoi(b, &v) || v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--budgets must be positive integers, got '", b, "'"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError("--budgets is empty");
  return out;
}

void Progress(int done, int total) {
  const int width = 30, filled = total ? done * width / total : width;
  std::fprintf(stderr, "\r[%s%s] %d/%d prompts", std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

std::string Cell(double x, const char* fmt) {
  return std::isnan(x) ? std::string("-") : absl::StrFormat(fmt, x);
}

absl::Status WriteJson(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  for (const auto& r : j) out << r.dump() << "\n";
  return out ? absl::OkStatus() : absl::DataLossError(absl::StrCat("write failed: ", path));
}

// NaN is not JSON: null instead.
nlohmann::json Num(double x) { return std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x); }

int Fidelity(const Flags& flags, const std::vector<std::string>& compression_args) {
  auto budgets = Budgets(flags);
  if (!budgets.ok()) return Fail("eval fidelity", budgets.status());
  auto methods = Methods(flags.GetList("policies"), compression_args);
  if (!methods.ok()) return Fail("eval fidelity", methods.status());
  auto gen = flags.GetInt("gen", 1, 4096);
  auto limit = flags.GetInt("limit", 0, 1 << 30);
  auto window = flags.GetInt("window", 1, 1 << 20);
  auto theta = flags.GetDouble("theta", 0, 1);
  for (const absl::Status& st : {gen.status(), limit.status(), window.status(), theta.status()}) {
    if (!st.ok()) return Fail("eval fidelity", st);
  }
  auto model = LoadModelFromFlags(flags);
  if (!model.ok()) return Fail("eval fidelity", model.status());
  auto prompts = ReadPrompts(flags.GetString("data"), (*model)->tokenizer(), false);
  if (!prompts.ok()) return Fail("eval fidelity", prompts.status());
  if (*limit > 0 && prompts->size() > static_cast<size_t>(*limit)) prompts->resize(*limit);
  std::fprintf(stderr, "model: %s\n%zu prompts, %lld generated tokens each\n",
               (*model)->description().c_str(), prompts->size(), static_cast<long long>(*gen));

  FidelityOptions opts;
  opts.gen = static_cast<int>(*gen);
  opts.window = static_cast<int>(*window);
  opts.theta = *theta;
  auto records = EvalFidelity(**model, *prompts, *methods, *budgets, opts, Progress);
  if (!records.ok()) return Fail("eval fidelity", records.status());

  std::printf("%-28s %7s %10s %9s %9s %9s %5s\n", "policy", "budget", "agreement", "KL",
              "recall", absl::StrFormat("hit@%.2g", *theta).c_str(), "n");
  nlohmann::json out = nlohmann::json::array();
  for (const FidelityRecord& r : *records) {
    std::printf("%-28s %7d %10s %9s %9s %9s %5d\n", r.policy.c_str(), r.budget,
                Cell(100 * r.agreement, "%.1f%%").c_str(), Cell(r.kl, "%.4f").c_str(),
                Cell(r.recall, "%.4f").c_str(), Cell(r.hit_rate, "%.4f").c_str(), r.n);
    out.push_back({{"policy", r.policy},
                   {"budget", r.budget},
                   {"agreement", Num(r.agreement)},
                   {"kl", Num(r.kl)},
                   {"recall", Num(r.recall)},
                   {"hit_rate", Num(r.hit_rate)},
                   {"n", r.n},
                   {"predictions", r.predictions}});
  }
  if (!flags.GetString("json").empty()) {
    if (absl::Status st = WriteJson(flags.GetString("json"), out); !st.ok()) {
      return Fail("eval fidelity", st);
    }
  }
  if (!flags.GetString("plot").empty()) {
    Figure fig;
    fig.title = absl::StrCat("KV compression fidelity: ", (*model)->description());
    Panel agree{"top-1 agreement with full KV", "budget (tokens per KV head)", "agreement", true, {}};
    Panel kl{"KL(full || compressed)", "budget (tokens per KV head)", "nats", true, {}};
    Panel recall{"attention-mass recall", "budget (tokens per KV head)", "recall", true, {}};
    auto series = [&](Panel& p, const std::string& name, auto field) {
      Series s{name, {}, {}};
      for (const auto& r : *records) {
        if (r.policy != name) continue;
        s.x.push_back(r.budget);
        s.y.push_back(field(r));
      }
      p.series.push_back(std::move(s));
    };
    for (const auto& m : *methods) {
      series(agree, m.name, [](const FidelityRecord& r) { return r.agreement; });
      series(kl, m.name, [](const FidelityRecord& r) { return r.kl; });
      series(recall, m.name, [](const FidelityRecord& r) { return r.recall; });
    }
    series(recall, "oracle", [](const FidelityRecord& r) { return r.recall; });
    fig.panels = {agree, kl, recall};
    if (absl::Status st = WritePng(fig, flags.GetString("plot")); !st.ok()) {
      return Fail("eval fidelity", st);
    }
  }
  return 0;
}

int Passkey(const Flags& flags, const std::vector<std::string>& compression_args) {
  auto budgets = Budgets(flags);
  if (!budgets.ok()) return Fail("eval passkey", budgets.status());
  auto methods = Methods(flags.GetList("policies"), compression_args);
  if (!methods.ok()) return Fail("eval passkey", methods.status());
  auto limit = flags.GetInt("limit", 0, 1 << 30);
  auto window = flags.GetInt("window", 1, 1 << 20);
  if (!limit.ok()) return Fail("eval passkey", limit.status());
  if (!window.ok()) return Fail("eval passkey", window.status());
  auto model = LoadModelFromFlags(flags);
  if (!model.ok()) return Fail("eval passkey", model.status());
  auto prompts = ReadPrompts(flags.GetString("data"), (*model)->tokenizer(), true);
  if (!prompts.ok()) return Fail("eval passkey", prompts.status());
  if (*limit > 0 && prompts->size() > static_cast<size_t>(*limit)) prompts->resize(*limit);
  std::fprintf(stderr, "model: %s\n%zu prompts\n", (*model)->description().c_str(),
               prompts->size());
  auto records =
      EvalPasskey(**model, *prompts, *methods, *budgets, static_cast<int>(*window), Progress);
  if (!records.ok()) return Fail("eval passkey", records.status());
  std::printf("%-28s %7s %9s %5s %8s\n", "policy", "budget", "accuracy", "n", "skipped");
  nlohmann::json out = nlohmann::json::array();
  for (const PasskeyRecord& r : *records) {
    std::printf("%-28s %7d %9s %5d %8d\n", r.policy.c_str(), r.budget,
                Cell(100 * r.accuracy, "%.1f%%").c_str(), r.n, r.skipped);
    out.push_back({{"policy", r.policy},
                   {"budget", r.budget},
                   {"accuracy", Num(r.accuracy)},
                   {"n", r.n},
                   {"skipped", r.skipped}});
  }
  if (!records->empty() && (*records)[0].skipped > 0) {
    std::fprintf(stderr, "%d prompts did not fit the model's context of %d and were skipped\n",
                 (*records)[0].skipped, (*model)->config().context_limit());
  }
  if (!flags.GetString("json").empty()) {
    if (absl::Status st = WriteJson(flags.GetString("json"), out); !st.ok()) {
      return Fail("eval passkey", st);
    }
  }
  if (!flags.GetString("plot").empty()) {
    Figure fig;
    fig.title = absl::StrCat("passkey retrieval: ", (*model)->description());
    Panel acc{"exact-match accuracy", "budget (tokens per KV head)", "accuracy", true, {}};
    for (const auto& m : *methods) {
      Series s{m.name, {}, {}};
      for (const auto& r : *records) {
        if (r.policy == m.name) {
          s.x.push_back(r.budget);
          s.y.push_back(r.accuracy);
        }
      }
      acc.series.push_back(std::move(s));
    }
    fig.panels = {acc};
    if (absl::Status st = WritePng(fig, flags.GetString("plot")); !st.ok()) {
      return Fail("eval passkey", st);
    }
  }
  return 0;
}

}  // namespace

int RunEval(int argc, char** argv) {
  const std::string sub = argc > 0 ? argv[0] : "";
  if (sub != "fidelity" && sub != "passkey") {
    std::fprintf(stderr,
                 "usage: kvwire eval fidelity|passkey --model DIR --data FILE.jsonl "
                 "--policies a,b --budgets 32,64,128 [--json FILE] [--plot FILE.png]\n");
    return sub == "--help" ? 0 : 2;
  }
  Flags flags;
  DefineModelFlags(flags);
  DefineCompressionFlags(flags);
  flags.Define("data", "", "JSONL prompts (../shared/data/stories/dev.jsonl, .../passkey/dev.jsonl)");
  flags.Define("policies", "snapkv,snapkv_pp,chunkkv,hbw,streaming,random",
               "methods: policy names, optionally with :flag=value overrides");
  flags.Define("budgets", "32,64,128", "budgets to evaluate (tokens per KV head)");
  flags.Define("limit", "0", "evaluate only the first N prompts (0: all)");
  flags.Define("json", "", "write one JSON record per policy and budget to this file");
  flags.Define("plot", "", "write a PNG plot to this file");
  if (sub == "fidelity") {
    flags.Define("gen", "32", "greedy tokens generated (and compared) per prompt");
    flags.Define("theta", "0.05", "attention threshold of SnapKV's hit rate");
  }
  const std::string usage = absl::StrCat("kvwire eval ", sub,
                                         " --model DIR --data FILE.jsonl --policies a,b "
                                         "--budgets 32,64,128 [--json FILE] [--plot FILE.png]");
  if (int rc = ParseFlagsOrExit(flags, "kvwire eval", usage, argc - 1, argv + 1, 0); rc >= 0) {
    return rc;
  }
  // The compression flags given on the command line, for the per-method re-parse.
  std::vector<std::string> compression_args;
  Flags probe;
  DefineCompressionFlags(probe);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    const std::string name = a.substr(2, a.find('=') == std::string::npos ? std::string::npos
                                                                          : a.find('=') - 2);
    if (!probe.IsDefined(name) || name == "policy" || name == "budget" || name == "ratio") continue;
    compression_args.push_back(a);
    if (a.find('=') == std::string::npos && i + 1 < argc) compression_args.push_back(argv[++i]);
  }
  return sub == "fidelity" ? Fidelity(flags, compression_args) : Passkey(flags, compression_args);
}

}  // namespace kvwire::tools
