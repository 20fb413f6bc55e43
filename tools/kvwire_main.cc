// The kvwire command-line tool: `kvwire COMMAND [flags]`. Each command lives in its own
// file under tools/ and registers here.
#include <cstdio>
#include <string>

#include "absl/strings/string_view.h"
#include "tools/commands.h"

namespace {

void Usage() {
  std::fprintf(stderr,
               "usage: kvwire COMMAND [flags]   (kvwire COMMAND --help for its flags)\n\n"
               "commands:\n");
  for (const auto& c : kvwire::tools::Commands()) {
    std::fprintf(stderr, "  %-18s %s\n", c.name, c.summary);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || absl::string_view(argv[1]) == "--help" || absl::string_view(argv[1]) == "-h") {
    Usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  for (const auto& c : kvwire::tools::Commands()) {
    if (name == c.name) return c.run(argc - 2, argv + 2);
  }
  std::fprintf(stderr, "kvwire: unknown command '%s'\n\n", name.c_str());
  Usage();
  return 2;
}
