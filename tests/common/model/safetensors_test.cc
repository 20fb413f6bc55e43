#include "common/model/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/test_util.h"

namespace kvwire {
namespace {

using testing::MakeTempDir;
using testing::ReadFile;
using testing::WriteFile;

std::string Header(const std::string& json) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

// Opens a file holding `contents` and returns the error message (or "ok").
std::string OpenError(const std::string& contents, absl::StatusCode* code = nullptr) {
  const std::string dir = MakeTempDir("st");
  const std::string path = dir + "/bad.safetensors";
  WriteFile(path, contents);
  auto f = SafetensorsFile::Open(path);
  if (code) *code = f.status().code();
  return f.ok() ? "ok" : std::string(f.status().message());
}

TEST(Safetensors, RoundTrip) {
  const std::string dir = MakeTempDir("roundtrip");
  const std::vector<float> a = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  const std::vector<uint16_t> b = {0x3f80, 0x4000};
  ASSERT_TRUE(WriteSafetensors(dir + "/x.safetensors",
                               {{"a", "F32", {2, 3}, a.data()}, {"b", "BF16", {2}, b.data()}},
                               {{"format", "pt"}})
                  .ok());
  auto f = SafetensorsFile::Open(dir + "/x.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorView* ta = (*f)->Find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, "F32");
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(ta->data, a.data(), 24), 0);
  EXPECT_EQ((*f)->Find("b")->bytes, 4u);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_EQ((*f)->Find("c"), nullptr);
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto f = SafetensorsFile::Open("/nonexistent/model.safetensors");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(f.status().message()).find("/nonexistent/model.safetensors"),
            std::string::npos);
}

TEST(Safetensors, RejectsMalformedFiles) {
  const std::string ok_tensor = R"("t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
  struct Case {
    std::string contents;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"abc", "8-byte header length"},
      {Header("{}").substr(0, 9), "does not fit"},  // truncated header
      {std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8) + "{}", "does not fit"},  // lying length
      {Header("{not json"), "not valid JSON"},
      {Header("[1, 2]"), "not a JSON object"},
      {Header("{" + ok_tensor + "}") + std::string(4, '\0'), "outside the 4 data bytes"},
      {Header(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})") +
           std::string(8, '\0'),
       "needs 12 bytes"},
      {Header(R"({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})") +
           std::string(8, '\0'),
       "unknown dtype 'Q4'"},
      {Header(R"({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})") +
           std::string(8, '\0'),
       "non-negative integers"},
      {Header(R"({"t": {"dtype": "F32", "shape": [2]}})"), "data_offsets"},
      {Header(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})") +
           std::string(8, '\0'),
       "outside"},
      {Header(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})") +
           std::string(12, '\0'),
       "overlap"},
      {Header(R"({"__metadata__": {"k": 3}})"), "__metadata__.k"},
  };
  for (const Case& c : cases) {
    absl::StatusCode code;
    const std::string msg = OpenError(c.contents, &code);
    EXPECT_EQ(code, absl::StatusCode::kInvalidArgument) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos)
        << "message: " << msg << "\nexpected: " << c.expect;
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << "message names the file: " << msg;
    // The same bytes in memory: the same error, naming the source.
    auto mem = SafetensorsFile::FromBytes(c.contents, "mem.safetensors");
    ASSERT_FALSE(mem.ok());
    EXPECT_EQ(mem.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string mem_msg(mem.status().message());
    EXPECT_NE(mem_msg.find(c.expect), std::string::npos) << mem_msg;
    EXPECT_NE(mem_msg.find("mem.safetensors"), std::string::npos) << mem_msg;
  }
}

TEST(Safetensors, FromBytesReadsWhatOpenReads) {
  const std::string dir = MakeTempDir("frombytes");
  const std::vector<float> a = {1.f, 2.f, 3.f};
  ASSERT_TRUE(
      WriteSafetensors(dir + "/x.safetensors", {{"a", "F32", {3}, a.data()}}, {{"format", "pt"}})
          .ok());
  auto f = SafetensorsFile::FromBytes(ReadFile(dir + "/x.safetensors"), "x");
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorView* ta = (*f)->Find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{3}));
  ASSERT_EQ(ta->bytes, 12u);
  EXPECT_EQ(std::memcmp(ta->data, a.data(), 12), 0);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
}

TEST(WeightFiles, ShardedIndex) {
  const std::string dir = MakeTempDir("sharded");
  const std::vector<float> a = {1.f, 2.f}, b = {3.f};
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model-00001-of-00002.safetensors", {{"a", "F32", {2}, a.data()}})
          .ok());
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model-00002-of-00002.safetensors", {{"b", "F32", {1}, b.data()}})
          .ok());
  WriteFile(dir + "/model.safetensors.index.json",
            R"({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}})");
  auto files = WeightFiles::OpenDirectory(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  auto tb = (*files)->Get("b");
  ASSERT_TRUE(tb.ok());
  EXPECT_EQ(reinterpret_cast<const float*>((*tb)->data)[0], 3.f);
  auto missing = (*files)->Get("c");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.status().message()).find("'c'"), std::string::npos);

  WriteFile(dir + "/model.safetensors.index.json",
            R"({"weight_map": {"a": "model-00002-of-00002.safetensors"}})");
  auto wrong = WeightFiles::OpenDirectory(dir);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(std::string(wrong.status().message()).find("has no such tensor"), std::string::npos);

  WriteFile(dir + "/model.safetensors.index.json", R"({"weight_map": {"a": "../etc/passwd"}})");
  auto escape = WeightFiles::OpenDirectory(dir);
  ASSERT_FALSE(escape.ok());
  EXPECT_NE(std::string(escape.status().message()).find("not a file name"), std::string::npos);
}

}  // namespace
}  // namespace kvwire
