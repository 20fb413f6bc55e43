// kvwire policies: the registries of compression policies and decode attention modes, with
// each one's paper and parameters (what --help's flags, the request fields and the docs
// are built from). --json for scripts, --markdown for docs.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tools/commands.h"

namespace kvwire::tools {
namespace {

nlohmann::json Registry() {
  nlohmann::json policies = nlohmann::json::array();
  for (const PolicyInfo* p : Policies()) {
    nlohmann::json params = nlohmann::json::array();
    for (const ParamInfo& q : p->params) {
      params.push_back({{"name", q.name},
                        {"flag", "--" + ParamFlagName(q.name)},
                        {"default", q.default_value},
                        {"help", q.help}});
    }
    const bool evicts = MakePolicy(p->name).value()->evicts();
    policies.push_back(
        {{"name", p->name},
         {"keeps", p->keeps},
         {"paper", p->paper},
         {"shared", evicts ? nlohmann::json{"budget", "ratio", "window", "skip_layers"}
                           : nlohmann::json::array()},
         {"params", params}});
  }
  nlohmann::json modes = nlohmann::json::array();
  for (const AttentionModeInfo* m : AttentionModes()) {
    modes.push_back({{"name", m->name}, {"paper", m->paper}, {"params", m->params}});
  }
  return {{"policies", policies}, {"attention_modes", modes}};
}

}  // namespace

int RunPolicies(int argc, char** argv) {
  Flags flags;
  flags.DefineBool("json", "print the registries as JSON");
  flags.DefineBool("markdown", "print them as Markdown tables");
  if (int rc = ParseFlagsOrExit(flags, "kvwire policies", "kvwire policies [--json|--markdown]",
                                argc, argv, 0);
      rc >= 0) {
    return rc;
  }
  const nlohmann::json r = Registry();
  if (flags.GetBool("json")) {
    std::printf("%s\n", r.dump(2).c_str());
    return 0;
  }
  const bool md = flags.GetBool("markdown");
  std::printf(md ? "| policy | keeps (per cache head, window included) | paper | parameters |\n"
                   "|---|---|---|---|\n"
                 : "compression policies (--policy; budget, ratio, window, skip_layers shared):\n");
  for (const auto& p : r["policies"]) {
    std::vector<std::string> params;
    for (const auto& q : p["params"]) {
      params.push_back(
          absl::StrCat(q["flag"].get<std::string>(), "=", q["default"].get<std::string>()));
    }
    const std::string list = params.empty() ? "-" : absl::StrJoin(params, md ? ", " : " ");
    if (md) {
      std::printf("| `%s` | %s | %s | %s |\n", p["name"].get<std::string>().c_str(),
                  p["keeps"].get<std::string>().c_str(), p["paper"].get<std::string>().c_str(),
                  list.c_str());
    } else {
      std::printf("  %-10s %s\n             paper: %s; parameters: %s\n",
                  p["name"].get<std::string>().c_str(), p["keeps"].get<std::string>().c_str(),
                  p["paper"].get<std::string>().c_str(), list.c_str());
    }
  }
  std::printf(md ? "\n| attention mode | paper | parameters |\n|---|---|---|\n"
                 : "\ndecode attention modes (--attention):\n");
  for (const auto& m : r["attention_modes"]) {
    std::vector<std::string> params = m["params"].get<std::vector<std::string>>();
    const std::string list = params.empty() ? "-" : absl::StrJoin(params, ", ");
    std::printf(md ? "| `%s` | %s | %s |\n" : "  %-10s %s; parameters: %s\n",
                m["name"].get<std::string>().c_str(), m["paper"].get<std::string>().c_str(),
                list.c_str());
  }
  return 0;
}

}  // namespace kvwire::tools
