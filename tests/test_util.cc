#include "tests/test_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace kvwire::testing {
namespace fs = std::filesystem;

std::string SourceDir() { return KVWIRE_SOURCE_DIR; }

std::string SharedDir() {
  if (const char* env = std::getenv("KVWIRE_SHARED_DIR"); env && *env) return env;
  // ../shared beside the checkout.
  const fs::path candidate = fs::path(SourceDir()).parent_path() / "shared";
  std::error_code ec;
  if (fs::is_directory(candidate / "models", ec)) return candidate.string();
  return "";
}

std::string StoriesModelDir() {
  const std::string shared = SharedDir();
  return shared.empty() ? "" : shared + "/models/stories260K-hf";
}

std::string MakeTempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  fs::path dir = fs::path(base && *base ? base : fs::temp_directory_path().string()) /
                 ("kvwire-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

}  // namespace kvwire::testing
