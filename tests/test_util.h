// Helpers shared by the tests: where ../shared is, scratch directories.
#pragma once

#include <string>

namespace kvwire::testing {

// The project's ../shared folder (models, data, papers), or "" when absent: tests that
// need it call GTEST_SKIP() with a message saying so.
std::string SharedDir();
// The stories260K-hf model folder, or "" when ../shared is absent.
std::string StoriesModelDir();
// The source tree (for committed fixtures).
std::string SourceDir();
// A fresh, empty directory under the test's temporary directory.
std::string MakeTempDir(const std::string& name);
// Whole-file read, "" when unreadable.
std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& contents);

}  // namespace kvwire::testing

#define KVWIRE_REQUIRE_SHARED()                                                    \
  do {                                                                             \
    if (::kvwire::testing::SharedDir().empty()) {                                  \
      GTEST_SKIP() << "../shared (models and data) not found beside the checkout"; \
    }                                                                              \
  } while (0)
