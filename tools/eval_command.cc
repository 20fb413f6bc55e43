// kvwire eval fidelity|passkey: compare compression policies on a dataset, with a
// progress bar, a table on stdout, --json records and a --plot PNG (drawn by matplotlib:
// tools/plot_eval.py, which the build puts beside the kvwire executable).
//
// Methods are policy names (rocketkv: both stages from one token budget) or decode
// attention modes over the full cache (hybrid, quest, exact_topk), optionally with
// parameter overrides after colons, e.g.
//   --policies snapkv,snapkv:gqa=per_query_head,hbw:groups=1,streaming,rocketkv,quest
// Overrides use the compression flags' names (see --help); the rest come from the flags.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "tools/commands.h"
#include "tools/eval.h"

namespace kvwire::tools {
namespace {

// One method per spec: a policy name with its own parameter overrides after colons
// ("snapkv:gqa=per_query_head", which must apply to it), plus the command line's compression
// values that apply to it (a --kernel given on the command line reaches snapkv and not
// snapkv_pp). A command-line value no method takes is an error. A decode attention mode
// (hybrid, quest, exact_topk) as the method: the full prompt cache, sparse reads of
// `budget` tokens per step (RocketKV's comparison points).
absl::StatusOr<std::vector<EvalMethod>> Methods(const std::vector<std::string>& specs,
                                                const ParamValues& shared) {
  std::vector<EvalMethod> methods;
  std::set<std::string> used;
  for (const std::string& spec : specs) {
    std::vector<std::string> parts = absl::StrSplit(spec, ':');
    auto mode = ParseAttentionMode(parts[0]);
    if (mode.ok() && *mode != AttentionMode::kDense) {
      if (parts.size() > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "method '", spec,
            "': a decode attention mode takes no overrides (its budget is --budgets)"));
      }
      const AttentionMode m = *mode;
      methods.push_back({spec, [](int) { return CompressionConfig{}; },
                         [m](int budget) {
                           DecodeAttentionConfig a;
                           a.mode = m;
                           a.token_budget = budget;
                           return a;
                         }});
      continue;
    }
    const std::string policy = mode.ok() ? "full" : parts[0];  // dense: the full cache
    const PolicyInfo* info = FindPolicy(policy);
    if (info == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("method '", spec, "': unknown policy '",
                                                     policy, "'; expected one of ", PolicyNames(),
                                                     " or a decode attention mode"));
    }
    ASSIGN_OR_RETURN(PolicyPtr probe, MakePolicy(policy));
    ParamValues values = {{"policy", policy}};
    for (const auto& [name, value] : shared) {
      bool takes = probe->evicts() && (name == "window" || name == "skip_layers");
      for (const ParamInfo& q : info->params) takes |= name == q.name;
      if (!takes) continue;
      values[name] = value;
      used.insert(name);
    }
    for (size_t i = 1; i < parts.size(); ++i) {
      std::pair<std::string, std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
      const std::string name = absl::StrReplaceAll(kv.first, {{"-", "_"}});
      if (name == "window") {
        // One prefill per prompt is captured, with --window's scores, for every method.
        return absl::InvalidArgumentError(
            absl::StrCat("method '", spec,
                         "': the observation window is the command's --window, not a "
                         "method's"));
      }
      values[name] = kv.second;
    }
    // Checked once with a budget every policy accepts, so errors surface before the run.
    if (probe->evicts()) values["budget"] = "1000000";
    CompressionConfig base;
    if (absl::Status st = ApplyCompressionValues(values, &base); !st.ok()) {
      return Annotate(AsFlagError(st), absl::StrCat("method '", spec, "'"));
    }
    methods.push_back({spec,
                       [base](int budget) {
                         CompressionConfig c = base;
                         if (c.policy->evicts()) c.budget = budget;
                         return c;
                       },
                       nullptr});
  }
  for (const auto& [name, value] : shared) {
    if (used.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", ParamFlagName(name), " applies to none of the methods (--policies); it applies to ",
          name == "window" || name == "skip_layers" ? std::string("every policy but full")
                                                    : PoliciesTaking(name)));
    }
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

// The directory of the running executable, where the build copies plot_eval.py.
absl::StatusOr<std::string> ExecutableDir() {
  std::string buf(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size());
  if (n <= 0 || static_cast<size_t>(n) >= buf.size()) {
    return absl::InternalError(
        absl::StrCat("cannot read /proc/self/exe: ", n <= 0 ? std::strerror(errno) : "too long"));
  }
  buf.resize(n);
  return buf.substr(0, buf.rfind('/'));
}

// Runs argv[0] (a path, or a name looked up in PATH) without a shell and returns its exit
// code; Unavailable when it could not be started.
absl::StatusOr<int> RunProgram(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);  // the child shares our stdout and stderr; keep their order
  std::fflush(stderr);
  pid_t pid = 0;
  const bool in_path = args[0].find('/') == std::string::npos;
  const int err = in_path ? posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ)
                          : posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat("cannot run ", args[0], ": ", std::strerror(err)));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return absl::InternalError(absl::StrCat("waitpid: ", std::strerror(errno)));
  }
  if (WIFSIGNALED(status)) {
    return absl::AbortedError(absl::StrCat(args[0], " was killed by signal ", WTERMSIG(status)));
  }
  return WEXITSTATUS(status);
}

// Draws `records` into `png` with plot_eval.py. The script reads the records from a file:
// --json's when given, else a temporary one, removed after a successful plot and kept (and
// named in the error) otherwise. $KVWIRE_PYTHON picks the interpreter; without it Debian's
// /usr/bin/python3 (where python3-matplotlib installs), else python3 from PATH.
absl::Status Plot(const nlohmann::json& records, const std::string& json_path,
                  const std::string& png, const std::string& title) {
  std::string path = json_path;
  if (path.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string name = absl::StrCat(tmp && *tmp ? tmp : "/tmp", "/kvwire-eval-XXXXXX.jsonl");
    const int fd = mkstemps(name.data(), 6);
    if (fd < 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot create a temporary file for the plot's records (", name,
                       "): ", std::strerror(errno)));
    }
    close(fd);
    path = name;
    if (absl::Status st = WriteJson(path, records); !st.ok()) {
      std::remove(path.c_str());
      return st;
    }
  }
  const std::string where = absl::StrCat("; the JSON records are in ", path);
  absl::StatusOr<std::string> dir = ExecutableDir();
  if (!dir.ok()) return absl::InternalError(absl::StrCat(dir.status().message(), where));
  const std::string script = *dir + "/plot_eval.py";
  if (access(script.c_str(), R_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot plot: ", script,
                     " is missing (the build copies tools/plot_eval.py beside the kvwire "
                     "executable)",
                     where));
  }
  std::string python = "python3";
  if (const char* env = std::getenv("KVWIRE_PYTHON"); env && *env) {
    python = env;
  } else if (access("/usr/bin/python3", X_OK) == 0) {
    python = "/usr/bin/python3";
  }
  absl::StatusOr<int> rc = RunProgram({python, script, "--title", title, "--", path, png});
  if (!rc.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot plot: ", rc.status().message(),
                     " (the plot needs python3 with matplotlib; Debian: apt-get install "
                     "python3-matplotlib)",
                     where));
  }
  if (*rc == 3) {  // plot_eval.py's code for "no matplotlib"
    return absl::FailedPreconditionError(
        absl::StrCat("cannot plot: matplotlib is not installed for ", python,
                     " (Debian: apt-get install python3-matplotlib; or set KVWIRE_PYTHON to a "
                     "python3 that has it)",
                     where));
  }
  if (*rc != 0) {
    return absl::InternalError(absl::StrCat("cannot plot: ", python, " ", script, " failed (exit ",
                                            *rc, ", its message is above)", where));
  }
  if (json_path.empty()) std::remove(path.c_str());
  return absl::OkStatus();
}

// NaN is not JSON: null instead.
nlohmann::json Num(double x) { return std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x); }

// What both evaluations start from: budgets, methods, the model and its prompts.
struct EvalSetup {
  std::vector<int> budgets;
  std::vector<EvalMethod> methods;
  std::unique_ptr<LlamaModel> model;
  std::vector<EvalPrompt> prompts;
  int window = 0;
};

absl::StatusOr<EvalSetup> Setup(const Flags& flags, const ParamValues& compression, bool passkey) {
  EvalSetup e;
  ASSIGN_OR_RETURN(e.budgets, Budgets(flags));
  ASSIGN_OR_RETURN(e.methods, Methods(flags.GetList("policies"), compression));
  ASSIGN_OR_RETURN(const int64_t limit, flags.GetInt("limit", 0, 1 << 30));
  ASSIGN_OR_RETURN(const int64_t window, flags.GetInt("window", 1, 1 << 20));
  e.window = static_cast<int>(window);
  ASSIGN_OR_RETURN(e.model, LoadModelFromFlags(flags));
  ASSIGN_OR_RETURN(e.prompts, ReadPrompts(flags.GetString("data"), e.model->tokenizer(), passkey));
  if (limit > 0 && e.prompts.size() > static_cast<size_t>(limit)) e.prompts.resize(limit);
  return e;
}

// What both evaluations end with: --json records and the --plot PNG.
absl::Status Outputs(const Flags& flags, const nlohmann::json& records, const std::string& title) {
  if (!flags.GetString("json").empty())
    RETURN_IF_ERROR(WriteJson(flags.GetString("json"), records));
  if (!flags.GetString("plot").empty()) {
    RETURN_IF_ERROR(Plot(records, flags.GetString("json"), flags.GetString("plot"), title));
  }
  return absl::OkStatus();
}

int Fidelity(const Flags& flags, const ParamValues& compression) {
  auto gen = flags.GetInt("gen", 1, 4096);
  auto theta = flags.GetDouble("theta", 0, 1);
  for (const absl::Status& st : {gen.status(), theta.status()}) {
    if (!st.ok()) return Fail("eval fidelity", st);
  }
  auto setup = Setup(flags, compression, /*passkey=*/false);
  if (!setup.ok()) return Fail("eval fidelity", setup.status());
  EvalSetup& e = *setup;
  std::fprintf(stderr, "model: %s\n%zu prompts, %lld generated tokens each\n",
               e.model->description().c_str(), e.prompts.size(), static_cast<long long>(*gen));
  FidelityOptions opts;
  opts.gen = static_cast<int>(*gen);
  opts.window = e.window;
  opts.theta = *theta;
  auto records = EvalFidelity(*e.model, e.prompts, e.methods, e.budgets, opts, Progress);
  if (!records.ok()) return Fail("eval fidelity", records.status());

  std::printf("%-28s %7s %10s %9s %9s %9s %5s\n", "policy", "budget", "agreement", "KL", "recall",
              absl::StrFormat("hit@%.2g", *theta).c_str(), "n");
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
  const absl::Status st =
      Outputs(flags, out, absl::StrCat("KV compression fidelity: ", e.model->description()));
  return st.ok() ? 0 : Fail("eval fidelity", st);
}

int Passkey(const Flags& flags, const ParamValues& compression) {
  auto setup = Setup(flags, compression, /*passkey=*/true);
  if (!setup.ok()) return Fail("eval passkey", setup.status());
  EvalSetup& e = *setup;
  std::fprintf(stderr, "model: %s\n%zu prompts\n", e.model->description().c_str(),
               e.prompts.size());
  auto records = EvalPasskey(*e.model, e.prompts, e.methods, e.budgets, e.window, Progress);
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
                 (*records)[0].skipped, e.model->config().context_limit());
  }
  const absl::Status st =
      Outputs(flags, out, absl::StrCat("passkey retrieval: ", e.model->description()));
  return st.ok() ? 0 : Fail("eval passkey", st);
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
  DefineCompressionParamFlags(flags);  // no --policy, --budget, --ratio: see --policies, --budgets
  flags.Define("data", "",
               "JSONL prompts (../shared/data/stories/dev.jsonl, .../passkey/dev.jsonl)");
  flags.Define("policies", "snapkv,snapkv_pp,chunkkv,hbw,streaming,random",
               "methods: policy names, optionally with :flag=value overrides");
  flags.Define("budgets", "32,64,128", "budgets to evaluate (tokens per KV head)");
  flags.Define("limit", "0", "evaluate only the first N prompts (0: all)");
  flags.Define("json", "", "write one JSON record per policy and budget to this file");
  flags.Define("plot", "", "write a PNG plot to this file (needs python3 with matplotlib)");
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
  // The compression values given on the command line; each method takes those that apply.
  const ParamValues compression = CompressionValuesFromFlags(flags);
  return sub == "fidelity" ? Fidelity(flags, compression) : Passkey(flags, compression);
}

}  // namespace kvwire::tools
