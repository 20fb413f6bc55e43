// Helpers shared by the tests: where ../shared is, scratch directories.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvwire::testing {

// The project's ../shared folder (models, data, papers), or "" when absent: tests that
// need it call GTEST_SKIP() with a message saying so.
std::string SharedDir();
// The stories260K-hf model folder, or "" when ../shared is absent.
std::string StoriesModelDir();
// The passkey-induction-hf retrieval model folder, or "" when ../shared is absent.
std::string PasskeyModelDir();

// A prompt of ../shared/data/passkey/dev.jsonl.
struct PasskeyCase {
  std::string id, task;
  double depth = 0;
  std::vector<int32_t> prompt_ids, answer_ids;
};
// The prompts of dev.jsonl with these ids, in this order; an id that is missing ends the
// test with a failure naming it (an empty list).
std::vector<PasskeyCase> ReadPasskeyCases(const std::vector<std::string>& ids);
// A handful of dev prompts across lengths (491 to 1975 tokens) and tasks, all with the
// needle at depth 0 to 0.56 (so far from the end that a recency window loses it).
inline const std::vector<std::string> kPasskeyHandful = {
    "dev-512-026", "dev-1024-025", "dev-1536-000", "dev-2000-001", "dev-2000-026"};

// True in the sanitizer builds (scripts/sanitize.sh), which run a forward 10x slower or more: a
// test that takes one path over many inputs takes it over one input there (its paths are what
// the sanitizers check).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// The source tree (for committed fixtures).
std::string SourceDir();
// A fresh, empty directory under the test's temporary directory.
std::string MakeTempDir(const std::string& name);
// Whole-file read, "" when unreadable.
std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& contents);

// The kernel's flags of the mapping that holds `p` (/proc/self/smaps' VmFlags line, e.g.
// " hg" for MADV_HUGEPAGE), or "" when no mapping shows them.
std::string VmFlagsOf(const void* p);
// Skips the test unless this kernel has transparent huge pages and shows VmFlags.
#define KVWIRE_REQUIRE_VMFLAGS()                                                      \
  do {                                                                                \
    if (!::kvwire::testing::HasVmFlags()) {                                           \
      GTEST_SKIP() << "no transparent huge pages here, or /proc/self/smaps shows no " \
                      "VmFlags";                                                      \
    }                                                                                 \
  } while (0)
bool HasVmFlags();

}  // namespace kvwire::testing

#define KVWIRE_REQUIRE_SHARED()                                                    \
  do {                                                                             \
    if (::kvwire::testing::SharedDir().empty()) {                                  \
      GTEST_SKIP() << "../shared (models and data) not found beside the checkout"; \
    }                                                                              \
  } while (0)
