#include "common/compression/compression_flags.h"

#include <cctype>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

// Every parameter name of every policy, with the policies taking it and its help.
struct FlagParam {
  std::string default_value, help;
  std::vector<std::string> policies;
};

std::map<std::string, FlagParam> PolicyParams() {
  std::map<std::string, FlagParam> params;
  for (const PolicyInfo* p : Policies()) {
    for (const ParamInfo& q : p->params) {
      FlagParam& f = params[q.name];
      if (f.policies.empty()) {
        f.default_value = q.default_value;
        f.help = q.help;
      }
      f.policies.push_back(p->name);
    }
  }
  return params;
}

}  // namespace

std::string ParamFlagName(absl::string_view param) {
  return absl::StrReplaceAll(param, {{"_", "-"}});
}

void DefineCompressionFlags(Flags& flags) {
  flags.Define("policy", "full", "KV compression policy: " + PolicyNames());
  flags.Define("budget", "0", "tokens kept per KV head, observation window included");
  flags.Define("ratio", "0", "alternative to --budget: kept / prompt tokens, in (0, 1]");
  DefineCompressionParamFlags(flags);
}

void DefineKvFormatFlag(Flags& flags) {
  flags.Define("kv-format", "auto",
               absl::StrCat("how kept K/V rows travel to the decode node: ", KvFormatNames(),
                            " (auto: the cache's dtype; fp8 (E4M3), int8 and int4 quantise keys "
                            "per channel over groups of tokens and values per row: "
                            "docs/wire_format.md)"));
}

void DefineCompressionParamFlags(Flags& flags) {
  flags.Define("window", "16", "observation window: last prompt tokens that score (always kept)");
  flags.Define("skip-layers", "0", "first layers kept dense (uncompressed)");
  for (const auto& [name, p] : PolicyParams()) {
    const std::string flag = ParamFlagName(name);
    if (flags.IsDefined(flag)) continue;
    flags.Define(flag, p.default_value,
                 absl::StrCat(p.help, " [", absl::StrJoin(p.policies, ", "), "]"));
  }
}

ParamValues CompressionValuesFromFlags(const Flags& flags) {
  ParamValues values;
  if (flags.IsDefined("policy") && flags.IsSet("policy"))
    values["policy"] = flags.GetString("policy");
  for (const char* name : kSharedCompressionParams) {
    const std::string flag = ParamFlagName(name);
    if (flags.IsDefined(flag) && flags.IsSet(flag)) values[name] = flags.GetString(flag);
  }
  for (const auto& [name, p] : PolicyParams()) {
    if (flags.IsSet(ParamFlagName(name))) values[name] = flags.GetString(ParamFlagName(name));
  }
  if (flags.IsDefined("kv-format") && flags.IsSet("kv-format")) {
    values["kv_format"] = flags.GetString("kv-format");
  }
  return values;
}

absl::Status AsFlagError(const absl::Status& status) {
  return RenameParams(status, [](absl::string_view p) { return "--" + ParamFlagName(p); });
}

absl::StatusOr<CompressionConfig> CompressionFromFlags(const Flags& flags,
                                                       const std::set<std::string>& shared) {
  ParamValues values = CompressionValuesFromFlags(flags);
  values["policy"] = flags.GetString("policy");
  if (const PolicyInfo* info = FindPolicy(values["policy"]); info != nullptr) {
    for (const std::string& flag : shared) {
      bool takes = false;
      for (const ParamInfo& q : info->params) takes |= ParamFlagName(q.name) == flag;
      if (!takes) values.erase(absl::StrReplaceAll(flag, {{"-", "_"}}));
    }
  }
  CompressionConfig config;
  RETURN_IF_ERROR(AsFlagError(ApplyCompressionValues(values, &config)));
  return config;
}

}  // namespace kvwire
