#include "common/base/flags.h"

#include <gtest/gtest.h>

namespace kvwire {
namespace {

Flags Make() {
  Flags f;
  f.Define("model", "", "model");
  f.Define("max-tokens", "16", "n");
  f.Define("top-p", "1", "p");
  f.DefineBool("verbose", "v");
  return f;
}

TEST(Flags, ParsesBothFormsAndDefaults) {
  Flags f = Make();
  ASSERT_TRUE(f.Parse({"--model", "dir", "--max-tokens=5", "--verbose", "pos"}).ok());
  EXPECT_EQ(f.GetString("model"), "dir");
  EXPECT_EQ(*f.GetInt("max-tokens", 1, 100), 5);
  EXPECT_TRUE(f.GetBool("verbose"));
  EXPECT_DOUBLE_EQ(*f.GetDouble("top-p", 0, 1), 1.0);
  EXPECT_FALSE(f.IsSet("top-p"));
  EXPECT_EQ(f.positional(), std::vector<std::string>{"pos"});
}

TEST(Flags, ErrorsSayWhichFlagAndWhatWasExpected) {
  Flags f = Make();
  absl::Status st = f.Parse({"--modle", "x"});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("--modle"), std::string::npos);

  Flags g = Make();
  EXPECT_FALSE(g.Parse({"--model"}).ok());  // needs a value

  Flags h = Make();
  ASSERT_TRUE(h.Parse({"--max-tokens", "-3", "--top-p", "abc"}).ok());
  auto n = h.GetInt("max-tokens", 1, 100);
  ASSERT_FALSE(n.ok());
  EXPECT_NE(std::string(n.status().message()).find("[1, 100]"), std::string::npos);
  EXPECT_NE(std::string(n.status().message()).find("-3"), std::string::npos);
  EXPECT_FALSE(h.GetDouble("top-p", 0, 1).ok());

  Flags b = Make();
  EXPECT_FALSE(b.Parse({"--verbose=maybe"}).ok());
}

}  // namespace
}  // namespace kvwire
