#include "tools/plot.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace kvwire::tools {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Chunk {
  std::string type;
  std::vector<uint8_t> data;
};

uint32_t Be32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | p[3];
}

std::vector<uint8_t> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Splits a PNG into chunks, failing the test on a bad signature, a truncated chunk or a
// CRC that zlib does not agree with.
std::vector<Chunk> ParsePng(const std::vector<uint8_t>& png) {
  const std::vector<uint8_t> signature = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<Chunk> chunks;
  if (png.size() < 8 || !std::equal(signature.begin(), signature.end(), png.begin())) {
    ADD_FAILURE() << "bad PNG signature";
    return chunks;
  }
  for (size_t at = 8; at < png.size();) {
    if (png.size() - at < 12) {
      ADD_FAILURE() << "truncated chunk header at byte " << at;
      break;
    }
    const uint32_t len = Be32(&png[at]);
    if (png.size() - at - 12 < len) {
      ADD_FAILURE() << "chunk at byte " << at << " overruns the file";
      break;
    }
    Chunk c{std::string(png.begin() + at + 4, png.begin() + at + 8),
            std::vector<uint8_t>(png.begin() + at + 8, png.begin() + at + 8 + len)};
    const uLong crc = crc32(0L, &png[at + 4], len + 4);
    EXPECT_EQ(Be32(&png[at + 8 + len]), crc) << "CRC of chunk " << c.type;
    chunks.push_back(std::move(c));
    at += 12 + len;
  }
  return chunks;
}

Series Line(std::string name, std::vector<double> x, std::vector<double> y) {
  return {std::move(name), std::move(x), std::move(y)};
}

Figure ThreePanelFigure() {
  const std::vector<double> budgets = {32, 64, 128, 256};
  Figure fig;
  fig.title = "KV budget sweep";
  fig.panels.push_back({"accuracy",
                        "budget (tokens)",
                        "accuracy",
                        true,
                        {Line("full", budgets, {0.9, 0.9, 0.9, 0.9}),
                         Line("snapkv", budgets, {0.55, 0.7, 0.82, 0.88}),
                         Line("streaming", budgets, {0.3, 0.45, 0.6, 0.74}),
                         Line("chunkkv", budgets, {0.6, 0.74, 0.85, 0.89})}});
  fig.panels.push_back({"latency",
                        "budget (tokens)",
                        "ms / token",
                        true,
                        {Line("snapkv", budgets, {11.5, 11.9, 12.6, 14.1}),
                         Line("streaming", budgets, {10.1, 10.2, 10.4, 10.9})}});
  // Awkward data: a NaN, an inf, a single point and a flat series must neither crash nor
  // blank the panel.
  fig.panels.push_back(
      {"memory",
       "budget (tokens)",
       "MiB",
       false,
       {Line("snapkv", budgets, {4, kNaN, 16, 32}), Line("streaming", {64}, {8}),
        Line("chunkkv", budgets, {5, 5, 5, std::numeric_limits<double>::infinity()})}});
  return fig;
}

struct Decoded {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> raw;  // Filter byte + RGB per row, as stored.
};

Decoded Decode(const std::string& path) {
  Decoded d;
  const std::vector<Chunk> chunks = ParsePng(ReadAll(path));
  if (chunks.size() < 3) {
    ADD_FAILURE() << "expected IHDR, IDAT, IEND; got " << chunks.size() << " chunks";
    return d;
  }
  EXPECT_EQ(chunks.front().type, "IHDR");
  EXPECT_EQ(chunks.back().type, "IEND");
  EXPECT_TRUE(chunks.back().data.empty());
  const std::vector<uint8_t>& ihdr = chunks.front().data;
  EXPECT_EQ(ihdr.size(), 13u);
  if (ihdr.size() != 13) return d;
  d.width = Be32(&ihdr[0]), d.height = Be32(&ihdr[4]);
  EXPECT_EQ(ihdr[8], 8) << "bit depth";
  EXPECT_EQ(ihdr[9], 2) << "colour type RGB";
  std::vector<uint8_t> z;
  for (const Chunk& c : chunks) {
    if (c.type == "IDAT") z.insert(z.end(), c.data.begin(), c.data.end());
  }
  const size_t expected = size_t{d.height} * (1 + 3 * size_t{d.width});
  d.raw.resize(expected + 1);  // One spare byte so a too-long stream shows as a wrong size.
  uLongf got = d.raw.size();
  EXPECT_EQ(uncompress(d.raw.data(), &got, z.data(), z.size()), Z_OK);
  EXPECT_EQ(got, expected);
  d.raw.resize(got);
  return d;
}

TEST(WritePng, WritesValidPngWithLinesInSeriesColours) {
  const std::string path = testing::TempDir() + "/plot_test_three.png";
  const Figure fig = ThreePanelFigure();
  ASSERT_TRUE(WritePng(fig, path).ok());
  const Decoded d = Decode(path);
  ASSERT_EQ(d.width, 3u * fig.panel_width);
  // One row of panels plus the title and legend bands.
  EXPECT_GT(d.height, static_cast<uint32_t>(fig.panel_height));
  EXPECT_LT(d.height, static_cast<uint32_t>(fig.panel_height + 100));
  ASSERT_EQ(d.raw.size(), size_t{d.height} * (1 + 3 * d.width));

  size_t ink = 0;
  std::vector<bool> seen(4, false);  // One per series name, in legend order.
  for (uint32_t y = 0; y < d.height; ++y) {
    const uint8_t* row = &d.raw[y * (1 + 3 * size_t{d.width})];
    ASSERT_EQ(row[0], 0) << "filter byte of row " << y;
    for (uint32_t x = 0; x < d.width; ++x) {
      const Rgb p{row[1 + 3 * x], row[2 + 3 * x], row[3 + 3 * x]};
      if (!(p == kWhite)) ++ink;
      for (int s = 0; s < 4; ++s) seen[s] = seen[s] || p == kPalette[s];
    }
  }
  EXPECT_GT(ink, size_t{d.width} * d.height / 50) << "hardly anything was drawn";
  for (int s = 0; s < 4; ++s) EXPECT_TRUE(seen[s]) << "no pixel in the colour of series " << s;
}

TEST(WritePng, FourPanelsWrapToASecondRow) {
  const std::string path3 = testing::TempDir() + "/plot_test_3.png";
  const std::string path4 = testing::TempDir() + "/plot_test_4.png";
  Figure fig = ThreePanelFigure();
  ASSERT_TRUE(WritePng(fig, path3).ok());
  fig.panels.push_back(fig.panels[0]);
  ASSERT_TRUE(WritePng(fig, path4).ok());
  const Decoded three = Decode(path3), four = Decode(path4);
  EXPECT_EQ(four.width, three.width);
  EXPECT_EQ(four.height, three.height + fig.panel_height);
}

TEST(WritePng, UnwritablePathIsAnErrorNamingThePath) {
  const std::string path = testing::TempDir() + "/no_such_dir/plot.png";
  const absl::Status st = WritePng(ThreePanelFigure(), path);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(std::string(st.message()).find(path), std::string::npos) << st;
}

TEST(WritePng, RejectsFiguresItCannotDraw) {
  const std::string path = testing::TempDir() + "/plot_test_bad.png";
  EXPECT_EQ(WritePng(Figure{}, path).code(), absl::StatusCode::kInvalidArgument);
  Figure fig = ThreePanelFigure();
  fig.panels[1].series[0].y.pop_back();
  const absl::Status st = WritePng(fig, path);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("snapkv"), std::string::npos) << st;
}

TEST(NiceTicks, StepsAreOneTwoOrFiveTimesAPowerOfTen) {
  EXPECT_EQ(NiceTicks(0, 1), (std::vector<double>{0, 0.2, 0.4, 0.6, 0.8, 1}));
  EXPECT_EQ(NiceTicks(3, 97), (std::vector<double>{20, 40, 60, 80}));
  EXPECT_EQ(NiceTicks(-12, 7), (std::vector<double>{-10, -5, 0, 5}));
  EXPECT_EQ(NiceTicks(0.912, 0.948), (std::vector<double>{0.92, 0.93, 0.94}));
  EXPECT_EQ(NiceTicks(3, 3), std::vector<double>{3});  // Empty range: no division by zero.
}

TEST(Canvas, TextAndLinesSetPixelsInsideTheCanvasOnly) {
  Canvas c(40, 20);
  EXPECT_EQ(Canvas::TextWidth("abc"), 17);
  EXPECT_EQ(Canvas::TextWidth("abc", 2), 34);
  c.Text(0, 0, "I", kBlack);
  EXPECT_EQ(c.Get(2, 0), kBlack);  // 'I' is a centred bar with serifs.
  EXPECT_EQ(c.Get(0, 3), kWhite);
  c.Line(-10, 15, 100, 15, kPalette[3], 2);  // Clipped, not a crash.
  EXPECT_EQ(c.Get(39, 15), kPalette[3]);
  EXPECT_EQ(c.Get(39, 16), kPalette[3]);
  EXPECT_EQ(c.Get(39, 17), kWhite);
}

}  // namespace
}  // namespace kvwire::tools
