#include "common/base/flags.h"

#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"

namespace kvwire {

void Flags::Define(const std::string& name, const std::string& default_value,
                   const std::string& help) {
  defs_[name] = Def{default_value, help, false};
}

void Flags::DefineBool(const std::string& name, const std::string& help) {
  defs_[name] = Def{"false", help, true};
}

absl::Status Flags::Parse(int argc, char** argv, int first) {
  std::vector<std::string> args;
  for (int i = first; i < argc; ++i) args.emplace_back(argv[i]);
  return Parse(args);
}

absl::Status Flags::Parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() < 3 || a.compare(0, 2, "--") != 0) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = defs_.find(name);
    if (it == defs_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, "; see --help"));
    }
    if (it->second.is_bool) {
      if (!has_value) value = "true";
      if (value != "true" && value != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " takes true or false, got '", value, "'"));
      }
    } else if (!has_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
    }
    values_[name] = value;
  }
  return absl::OkStatus();
}

bool Flags::IsSet(const std::string& name) const { return values_.count(name) > 0; }

std::string Flags::GetString(const std::string& name) const {
  auto v = values_.find(name);
  if (v != values_.end()) return v->second;
  auto d = defs_.find(name);
  KVWIRE_CHECK(d != defs_.end());  // asking for an undeclared flag is a bug
  return d->second.default_value;
}

absl::StatusOr<int64_t> Flags::GetInt(const std::string& name, int64_t min, int64_t max) const {
  const std::string s = GetString(name);
  int64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v < min || v > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be an integer in [", min, ", ", max, "], got '", s, "'"));
  }
  return v;
}

absl::StatusOr<double> Flags::GetDouble(const std::string& name, double min, double max) const {
  const std::string s = GetString(name);
  double v = 0;
  if (!absl::SimpleAtod(s, &v) || !(v >= min && v <= max)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be a number in [", min, ", ", max, "], got '", s, "'"));
  }
  return v;
}

bool Flags::GetBool(const std::string& name) const { return GetString(name) == "true"; }

std::vector<std::string> Flags::GetList(const std::string& name) const {
  const std::string s = GetString(name);
  if (s.empty()) return {};
  return absl::StrSplit(s, ',', absl::SkipEmpty());
}

std::string Flags::Help() const {
  std::string out;
  for (const auto& [name, def] : defs_) {
    std::string left = absl::StrCat("  --", name, def.is_bool ? "" : " VALUE");
    if (left.size() < 28) left.resize(28, ' ');
    absl::StrAppend(&out, left, " ", def.help);
    if (!def.is_bool && !def.default_value.empty()) {
      absl::StrAppend(&out, " (default ", def.default_value, ")");
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

int ParseFlagsOrExit(Flags& flags, const std::string& program, const std::string& usage, int argc,
                     char** argv, int first) {
  if (!flags.IsDefined("help")) flags.DefineBool("help", "print this help");
  if (absl::Status st = flags.Parse(argc, argv, first); !st.ok()) {
    std::fprintf(stderr, "%s: %s\nusage: %s\n", program.c_str(), std::string(st.message()).c_str(),
                 usage.c_str());
    return 2;
  }
  if (flags.GetBool("help")) {
    std::printf("usage: %s\n\nflags:\n%s", usage.c_str(), flags.Help().c_str());
    return 0;
  }
  return -1;
}

}  // namespace kvwire
