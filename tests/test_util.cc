#include "tests/test_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "gtest/gtest.h"

namespace kvwire::testing {
namespace fs = std::filesystem;

// The checkout the tests were built from; KVWIRE_SOURCE_DIR in the environment names another
// copy of it (the GPU machine's, where scripts/device_run.sh runs the bundled binaries).
std::string SourceDir() {
  if (const char* env = std::getenv("KVWIRE_SOURCE_DIR"); env && *env) return env;
  return KVWIRE_SOURCE_DIR;
}

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

std::string PasskeyModelDir() {
  const std::string shared = SharedDir();
  return shared.empty() ? "" : shared + "/models/passkey-induction-hf";
}

std::vector<PasskeyCase> ReadPasskeyCases(const std::vector<std::string>& ids) {
  const std::string path = SharedDir() + "/data/passkey/dev.jsonl";
  std::ifstream in(path);
  std::map<std::string, PasskeyCase> all;
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    PasskeyCase c;
    c.id = j.at("id").get<std::string>();
    c.task = j.at("task").get<std::string>();
    c.depth = j.at("depth").get<double>();
    c.prompt_ids = j.at("prompt_ids").get<std::vector<int32_t>>();
    c.answer_ids = j.at("answer_ids").get<std::vector<int32_t>>();
    all[c.id] = std::move(c);
  }
  std::vector<PasskeyCase> out;
  for (const std::string& id : ids) {
    auto it = all.find(id);
    if (it == all.end()) {
      ADD_FAILURE() << path << " has no prompt " << id;
      return {};
    }
    out.push_back(it->second);
  }
  return out;
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

std::string VmFlagsOf(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " ", &lo, &hi) == 2 &&
        line.find(':') > line.find('-')) {
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

bool HasVmFlags() {
  const int on_stack = 0;
  return static_cast<bool>(std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) &&
         !VmFlagsOf(&on_stack).empty();
}

}  // namespace kvwire::testing
