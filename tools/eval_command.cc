// kvwire eval fidelity|passkey: compare compression policies on a dataset, with a
// progress bar, a table on stdout, --json records and a --plot PNG (drawn by matplotlib:
// tools/plot_eval.py, which the build puts beside the kvwire executable).
//
// Methods are policy names (rocketkv: both stages from one token budget) or decode
// attention modes over the full cache (hybrid, quest, exact_topk), optionally with
// parameter overrides after colons, e.g.
//   --policies snapkv,snapkv:gqa=per_query_head,hbw:groups=1,streaming,rocketkv,quest
// Overrides use the compression flags' names (see --help); the rest come from the flags.
// `eval passkey --target HOST:PORT` sends every prompt through a running deployment
// instead, and --answers / --compare check it against the in-process run prompt for prompt.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
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
#include "tools/passkey.h"
#include "tools/passkey_remote.h"

namespace kvwire::tools {
namespace {

// --settings paper: the settings of each paper's own experiments, for the methods whose
// paper differs from kvwire's defaults.
struct PaperSetting {
  const char* policy;
  const char* param;
  const char* value;
};
constexpr PaperSetting kPaperSettings[] = {
    {"snapkv_pp", "window", "32"},  // RocketKV App. A.3: "observation window size of 32"
    {"rocketkv", "window", "32"},
};

// One method per spec: a policy name with its own parameter overrides after colons
// ("snapkv:gqa=per_query_head", "snapkv_pp:window=32", which must apply to it), plus the
// command line's compression values that apply to it (a --kernel given on the command line
// reaches snapkv and not snapkv_pp), plus, with `paper`, the paper's settings where neither
// set the parameter. A command-line value no method takes is an error. A decode attention
// mode (hybrid, quest, exact_topk) as the method: the full prompt cache, sparse reads of
// `budget` tokens per step (RocketKV's comparison points).
absl::StatusOr<std::vector<EvalMethod>> Methods(const std::vector<std::string>& specs,
                                                const ParamValues& shared, bool paper) {
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
      values[name] = kv.second;
    }
    for (const PaperSetting& p : kPaperSettings) {
      if (paper && policy == p.policy && values.count(p.param) == 0) values[p.param] = p.value;
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

absl::StatusOr<std::vector<KvFormat>> KvFormats(const Flags& flags) {
  std::vector<KvFormat> out;
  for (const std::string& name : flags.GetList("kv-formats")) {
    auto f = ParseKvFormat(name);
    if (!f.ok())
      return absl::InvalidArgumentError(absl::StrCat("--kv-formats: ", f.status().message()));
    if (std::find(out.begin(), out.end(), *f) != out.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--kv-formats names ", name, " twice"));
    }
    out.push_back(*f);
  }
  if (out.empty()) return absl::InvalidArgumentError("--kv-formats is empty");
  return out;
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

// A bar redrawn in place on a terminal; in a log (stderr not a terminal) one line at each
// tenth of the run, so that a long evaluation does not flood it.
void Progress(int done, int total) {
  static const bool tty = isatty(STDERR_FILENO) == 1;
  if (!tty) {
    const int tenth = total ? done * 10 / total : 10;
    const int before = total ? (done - 1) * 10 / total : 10;
    if (done == total || tenth != before) {
      std::fprintf(stderr, "%d/%d prompts (%d%%)\n", done, total, total ? done * 100 / total : 100);
    }
    return;
  }
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
  const std::string settings = flags.GetString("settings");
  if (settings != "default" && settings != "paper") {
    return absl::InvalidArgumentError(
        absl::StrCat("--settings must be default or paper, got '", settings, "'"));
  }
  ASSIGN_OR_RETURN(e.methods, Methods(flags.GetList("policies"), compression, settings == "paper"));
  ASSIGN_OR_RETURN(const std::vector<KvFormat> formats, KvFormats(flags));
  e.methods = InFormats(e.methods, formats);
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

  std::printf("%-28s %6s %7s %10s %9s %9s %9s %5s\n", "policy", "format", "budget", "agreement",
              "KL", "recall", absl::StrFormat("hit@%.2g", *theta).c_str(), "n");
  nlohmann::json out = nlohmann::json::array();
  for (const FidelityRecord& r : *records) {
    std::printf("%-28s %6s %7d %10s %9s %9s %9s %5d\n", r.policy.c_str(), r.kv_format.c_str(),
                r.budget, Cell(100 * r.agreement, "%.1f%%").c_str(), Cell(r.kl, "%.4f").c_str(),
                Cell(r.recall, "%.4f").c_str(), Cell(r.hit_rate, "%.4f").c_str(), r.n);
    out.push_back({{"policy", r.policy},
                   {"kv_format", r.kv_format},
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

// The flags of `eval passkey --target` (a deployment) and of the in-process evaluation;
// one given in the other mode is an error.
const std::vector<std::string> kRemoteFlags = {
    "concurrency", "timeout-s", "tls-ca", "tls-cert", "tls-key", "tls-server-name", "warm-pass"};
const std::vector<std::string> kInProcessFlags = {"dtype", "threads", "backend"};

absl::Status CheckModeFlags(const Flags& flags, bool remote) {
  for (const std::string& f : remote ? kInProcessFlags : kRemoteFlags) {
    if (flags.IsSet(f)) {
      return absl::InvalidArgumentError(
          remote ? absl::StrCat("--", f,
                                " does not apply with --target: the deployment runs the model "
                                "(--model only reads the prompts with its tokenizer)")
                 : absl::StrCat("--", f, " applies only with --target HOST:PORT"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RemoteOptions> RemoteOptionsFromFlags(const Flags& flags) {
  RemoteOptions o;
  o.target = flags.GetString("target");
  ASSIGN_OR_RETURN(const int64_t concurrency, flags.GetInt("concurrency", 1, 256));
  ASSIGN_OR_RETURN(const double timeout_s, flags.GetDouble("timeout-s", 0.001, 86400));
  o.concurrency = static_cast<int>(concurrency);
  o.timeout_ms = static_cast<int>(timeout_s * 1000);
  o.tls = {flags.GetString("tls-ca"), flags.GetString("tls-cert"), flags.GetString("tls-key"),
           flags.GetString("tls-server-name")};
  o.warm_pass = flags.IsDefined("warm-pass") && flags.GetBool("warm-pass");
  if (o.tls.ca_file.empty() &&
      (!o.tls.cert_file.empty() || !o.tls.key_file.empty() || !o.tls.server_name.empty())) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key and --tls-server-name need --tls-ca (TLS)");
  }
  return o;
}

// One table line per method, format and budget: accuracy over all prompts, per task and per
// length bucket, the needle kept and read, and the compression ratio (full cache ÷ KV payload,
// and the full cache in bf16 ÷ KV payload; through a deployment also full ÷ the KV messages'
// bytes).
void PrintPasskeyTable(const std::vector<PasskeyRow>& rows, bool wire) {
  std::vector<std::string> columns;  // "single", "multi", "≤512", ...
  std::set<std::string> seen;
  auto label = [](const PasskeyRow& r) { return r.length ? absl::StrCat("<=", r.length) : r.task; };
  for (const PasskeyRow& r : rows) {
    if ((r.task != "all" || r.length != 0) && seen.insert(label(r)).second) {
      columns.push_back(label(r));
    }
  }
  std::string head = absl::StrFormat("%-28s %6s %6s %7s", "policy", "format", "budget", "all");
  for (const std::string& c : columns) absl::StrAppendFormat(&head, " %7s", c);
  absl::StrAppendFormat(&head, " %7s %7s %7s %9s", "kept", "read", "ratio", "bf16/kv");
  if (wire) absl::StrAppendFormat(&head, " %7s", "wire");
  absl::StrAppendFormat(&head, " %5s", "n");
  std::printf("%s\n", head.c_str());
  for (size_t i = 0; i < rows.size(); ++i) {
    const PasskeyRow& all = rows[i];
    if (all.task != "all" || all.length != 0) continue;
    std::map<std::string, const PasskeyRow*> by;
    for (size_t k = i + 1; k < rows.size() && (rows[k].task != "all" || rows[k].length != 0); ++k) {
      by[label(rows[k])] = &rows[k];
    }
    std::string line = absl::StrFormat("%-28s %6s %6d %7s", all.method, all.kv_format, all.budget,
                                       Cell(100 * all.accuracy(), "%.1f%%"));
    for (const std::string& c : columns) {
      absl::StrAppendFormat(&line, " %7s",
                            by.count(c) ? Cell(100 * by[c]->accuracy(), "%.1f%%") : "-");
    }
    absl::StrAppendFormat(&line, " %7s %7s %7s", Cell(100 * all.needle_kept_share(), "%.1f%%"),
                          Cell(100 * all.needle_read_share(), "%.1f%%"),
                          Cell(all.ratio(), "%.2fx"));
    absl::StrAppendFormat(&line, " %9s", Cell(all.ratio_bf16(), "%.2fx"));
    if (wire) absl::StrAppendFormat(&line, " %7s", Cell(all.wire_ratio(), "%.2fx"));
    absl::StrAppendFormat(&line, " %5d", all.n);
    std::printf("%s\n", line.c_str());
  }
}

// --warm-pass: per method, format and budget, the cold and the warm request's TTFT (medians,
// at the decode node), the warm one's prompt tokens found cached, and its answers against the
// cold ones'.
void PrintWarmPass(const std::vector<PasskeyAnswer>& answers) {
  struct Group {
    std::vector<double> cold, warm;
    int64_t prompt = 0, cached = 0;
    int same = 0;
  };
  std::map<std::string, Group> groups;
  for (const PasskeyAnswer& a : answers) {
    Group& g = groups[absl::StrFormat("%-28s %6s %6d", a.method, a.kv_format, a.budget)];
    g.cold.push_back(a.ttft_ms);
    g.warm.push_back(a.warm_ttft_ms);
    g.prompt += a.prompt_tokens;
    g.cached += std::max(0, a.warm_cached_tokens);
    g.same += a.warm_tokens == a.tokens;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  std::printf("warm pass (the same request again): TTFT at the decode node, medians\n");
  std::printf("%-28s %6s %6s %10s %10s %7s %8s %12s\n", "policy", "format", "budget", "cold_ms",
              "warm_ms", "ratio", "cached", "same_answer");
  for (const auto& [key, g] : groups) {
    const double cold = median(g.cold), warm = median(g.warm);
    std::printf("%s %10.1f %10.1f %7.3f %7.1f%% %7d/%-4zu\n", key.c_str(), cold, warm,
                cold > 0 ? warm / cold : 0.0, 100.0 * g.cached / std::max<int64_t>(1, g.prompt),
                g.same, g.cold.size());
  }
}

absl::Status WriteAnswers(const std::string& path, const std::vector<PasskeyAnswer>& answers) {
  nlohmann::json j = nlohmann::json::array();
  for (const PasskeyAnswer& a : answers) j.push_back(ToJson(a));
  return WriteJson(path, j);
}

int Passkey(const Flags& flags, const ParamValues& compression) {
  const bool remote = !flags.GetString("target").empty();
  if (absl::Status st = CheckModeFlags(flags, remote); !st.ok()) return Fail("eval passkey", st);
  absl::StatusOr<RemoteOptions> remote_options = RemoteOptions{};
  if (remote) remote_options = RemoteOptionsFromFlags(flags);
  if (!remote_options.ok()) return Fail("eval passkey", remote_options.status());
  auto setup = Setup(flags, compression, /*passkey=*/true);
  if (!setup.ok()) return Fail("eval passkey", setup.status());
  EvalSetup& e = *setup;
  std::fprintf(stderr, "%s\n%zu prompts\n",
               remote ? absl::StrCat("deployment: ", remote_options->target).c_str()
                      : absl::StrCat("model: ", e.model->description()).c_str(),
               e.prompts.size());
  absl::StatusOr<PasskeyRun> run;
  if (remote) {
    // As in process, a prompt whose answer does not fit the model's context is skipped.
    std::vector<EvalPrompt> fit;
    std::vector<std::string> skipped;
    for (EvalPrompt& p : e.prompts) {
      if (p.ids.size() + p.answer.size() > static_cast<size_t>(e.model->config().context_limit())) {
        skipped.push_back(p.id);
      } else {
        fit.push_back(std::move(p));
      }
    }
    run = EvalPasskeyRemote(*remote_options, fit, e.methods, e.budgets, Progress);
    if (run.ok()) {
      run->skipped = std::move(skipped);
      // The bf16 figure from the prompt's length: the deployment reports its own dtype's.
      for (PasskeyAnswer& a : run->answers) {
        a.full_bf16_bytes =
            int64_t{a.prompt_tokens} * e.model->config().KvBytesPerToken(DType::kBF16);
      }
    }
  } else {
    run = EvalPasskey(*e.model, e.prompts, e.methods, e.budgets, e.window, Progress);
  }
  if (!run.ok()) return Fail("eval passkey", run.status());
  const std::vector<PasskeyRow> rows = SummarizePasskey(run->answers);
  PrintPasskeyTable(rows, remote);
  if (remote_options->warm_pass) PrintWarmPass(run->answers);
  if (!run->skipped.empty()) {
    std::fprintf(stderr, "%zu prompts did not fit the model's context of %d and were skipped\n",
                 run->skipped.size(), e.model->config().context_limit());
  }
  nlohmann::json out = nlohmann::json::array();
  for (const PasskeyRow& r : rows) {
    out.push_back(ToJson(r));
    out.back()["skipped"] = run->skipped.size();
  }
  absl::Status st =
      Outputs(flags, out, absl::StrCat("passkey retrieval: ", e.model->description()));
  if (st.ok() && !flags.GetString("answers").empty()) {
    st = WriteAnswers(flags.GetString("answers"), run->answers);
  }
  if (!st.ok()) return Fail("eval passkey", st);
  if (const std::string ref = flags.GetString("compare"); !ref.empty()) {
    auto diffs = ComparePasskey(run->answers, ref);
    if (!diffs.ok()) return Fail("eval passkey", diffs.status());
    for (const std::string& d : *diffs) std::fprintf(stderr, "differs: %s\n", d.c_str());
    std::fprintf(stderr, "%zu of %zu answers differ from %s\n", diffs->size(), run->answers.size(),
                 ref.c_str());
    if (!diffs->empty()) return 1;
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
  DefineCompressionParamFlags(flags);  // no --policy, --budget, --ratio: see --policies, --budgets
  flags.Define("data", "",
               "JSONL prompts (../shared/data/stories/dev.jsonl, .../passkey/dev.jsonl)");
  flags.Define("policies", "snapkv,snapkv_pp,chunkkv,hbw,streaming,random",
               "methods: policy names, optionally with :flag=value overrides");
  flags.Define("budgets", "32,64,128", "budgets to evaluate (tokens per KV head)");
  flags.Define("kv-formats", "auto",
               absl::StrCat("KV formats to evaluate every method in (", KvFormatNames(),
                            "): how the kept rows travel and are held"));
  flags.Define("limit", "0", "evaluate only the first N prompts (0: all)");
  flags.Define("json", "", "write one JSON record per policy and budget to this file");
  flags.Define("plot", "", "write a PNG plot to this file (needs python3 with matplotlib)");
  flags.Define("settings", "default",
               "default (kvwire's defaults), or paper: each method's paper settings where "
               "neither the method nor the command line sets them (window 32 for snapkv_pp "
               "and rocketkv)");
  if (sub == "fidelity") {
    flags.Define("gen", "32", "greedy tokens generated (and compared) per prompt");
    flags.Define("theta", "0.05", "attention threshold of SnapKV's hit rate");
  } else {
    flags.Define("answers", "", "write one JSON record per prompt, method and budget here");
    flags.Define("compare", "",
                 "compare the answers with an --answers file prompt for prompt; exit 1 on a "
                 "difference");
    flags.Define("target", "",
                 "evaluate through a running deployment: HOST:PORT of the router or a decode "
                 "node (one Generate call per prompt, method and budget)");
    flags.Define("concurrency", "1", "with --target: requests in flight");
    flags.DefineBool("warm-pass",
                     "with --target: send each request twice, cold then warm (the prefill tier's "
                     "prefix cache), and report both TTFTs and whether the answers agree");
    flags.Define("timeout-s", "120", "with --target: deadline of each request, seconds");
    flags.Define("tls-ca", "", "with --target: CA of the server's certificate (enables TLS)");
    flags.Define("tls-cert", "", "with --target: client certificate (mutual TLS)");
    flags.Define("tls-key", "", "with --target: client key (mutual TLS)");
    flags.Define("tls-server-name", "", "with --target: name to check in the certificate");
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
