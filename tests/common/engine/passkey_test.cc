// The engine on the retrieval model of ../shared (passkey-induction-hf): with the full
// cache its greedy answer to passkey prompts is the reference answer its README gives (the
// dataset's answer_ids, which an independent implementation reproduces on every dev
// prompt). What compression does to the answers is tested through the service pair
// (tests/decode_service/passkey_pair_test.cc, against this engine in process).
#include <gtest/gtest.h>

#include "common/engine/generate.h"
#include "tests/engine_fakes.h"
#include "tests/test_util.h"

namespace kvwire {
namespace {

TEST(Passkey, FullCacheAnswersAsTheReference) {
  KVWIRE_REQUIRE_SHARED();
  auto model = testing::LoadModel(testing::PasskeyModelDir());
  ASSERT_NE(model, nullptr);
  const auto cases = testing::ReadPasskeyCases(
      {"dev-512-000", "dev-512-001", "dev-1024-025", "dev-1536-026", "dev-2000-001"});
  ASSERT_EQ(cases.size(), 5u);
  for (const auto& c : cases) {
    auto r = Generate(*model, testing::PasskeyRequest(c));
    ASSERT_TRUE(r.ok()) << c.id << ": " << r.status();
    EXPECT_EQ(r->ids, c.answer_ids) << c.id;
  }
}

}  // namespace
}  // namespace kvwire
