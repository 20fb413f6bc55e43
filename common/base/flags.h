// Command-line flags for the kvwire tools and servers: `--name value` or `--name=value`,
// declared up front so that an unknown or malformed flag is an error that says which
// flag and what was expected, and so that --help lists them.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire {

class Flags {
 public:
  // Declares a flag with a default (empty: no default) and a one-line description.
  void Define(const std::string& name, const std::string& default_value, const std::string& help);
  // Declares a boolean flag (`--name`, `--name=true|false`), default false.
  void DefineBool(const std::string& name, const std::string& help);

  // Parses argv[first..argc). Positional arguments are collected in positional().
  absl::Status Parse(int argc, char** argv, int first = 1);
  absl::Status Parse(const std::vector<std::string>& args);

  bool IsSet(const std::string& name) const;  // given on the command line
  bool IsDefined(const std::string& name) const { return defs_.count(name) > 0; }
  std::string GetString(const std::string& name) const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t min, int64_t max) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double min, double max) const;
  bool GetBool(const std::string& name) const;
  // Comma-separated list; empty flag gives an empty list.
  std::vector<std::string> GetList(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }

  std::string Help() const;

 private:
  struct Def {
    std::string default_value;
    std::string help;
    bool is_bool = false;
  };
  std::map<std::string, Def> defs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// The start of every main: defines --help, parses argv[first..argc) and returns -1 to go
// on, 0 after printing the help, or 2 after printing what was wrong ("PROGRAM: error")
// and the usage line. The caller returns a non-negative result as its exit code.
int ParseFlagsOrExit(Flags& flags, const std::string& program, const std::string& usage, int argc,
                     char** argv, int first = 1);

}  // namespace kvwire
