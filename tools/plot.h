// A small, dependency-free (zlib aside) PNG line-chart writer for `kvwire eval --plot FILE`.
// Panels sit side by side (rows of at most 3) above one legend shared by series name, so the
// same policy keeps the same colour in every panel.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace kvwire::tools {

// One line with a marker at each point. NaN/inf points (and x <= 0 on a log2 axis) are
// skipped and leave a gap in the line.
struct Series {
  std::string name;
  std::vector<double> x, y;
};

struct Panel {
  std::string title, x_label, y_label;
  bool log2_x = false;  // KV budgets (32, 64, 128, ...) read best on a log2 axis.
  std::vector<Series> series;
};

struct Figure {
  std::string title;
  std::vector<Panel> panels;
  int panel_width = 420, panel_height = 320;
};

// Renders the figure and writes it as an RGB PNG. InvalidArgument for a figure it cannot
// draw (no panels, a tiny panel size, x and y of different lengths); a file error names path.
absl::Status WritePng(const Figure& fig, const std::string& path);

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

// Ten distinguishable colours (Tableau 10); the i-th distinct series name in the figure
// (legend order) gets kPalette[i % 10] in every panel.
inline constexpr Rgb kPalette[10] = {
    {31, 119, 180}, {255, 127, 14},  {44, 160, 44},   {214, 39, 40},  {148, 103, 189},
    {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207}};
inline constexpr Rgb kWhite{255, 255, 255};
inline constexpr Rgb kBlack{0, 0, 0};

// Steps of 1, 2 or 5 times a power of ten giving about `target` ticks inside [lo, hi].
std::vector<double> NiceTicks(double lo, double hi, int target = 5);

// An RGB raster; drawing outside it is clipped, so callers need not check bounds.
class Canvas {
 public:
  // 5x7 font, 1 px between characters; descenders reach kDescent rows below kGlyphH.
  static constexpr int kGlyphW = 5, kGlyphH = 7, kAdvance = 6, kDescent = 2;

  Canvas(int width, int height, Rgb background = kWhite);
  int width() const { return width_; }
  int height() const { return height_; }

  void Set(int x, int y, Rgb c);
  Rgb Get(int x, int y) const;  // Requires 0 <= x < width, 0 <= y < height.
  void FillRect(int x, int y, int w, int h, Rgb c);
  void Rect(int x, int y, int w, int h, Rgb c);  // 1 px outline.
  // Bresenham with a square `thickness` x `thickness` brush.
  void Line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1);
  void Disc(int cx, int cy, int radius, Rgb c);
  // Top-left at (x, y); characters outside 32..126 draw as '?'.
  void Text(int x, int y, std::string_view s, Rgb c, int scale = 1);
  // Rotated 90 degrees anticlockwise, reading upwards; (x, y) is the bottom-left corner.
  void TextUp(int x, int y, std::string_view s, Rgb c, int scale = 1);
  static int TextWidth(std::string_view s, int scale = 1);

  // PNG: colour type 2 (RGB, 8 bit), one zlib stream in one IDAT, filter 0 on every row.
  std::vector<uint8_t> EncodePng() const;

 private:
  int width_, height_;
  std::vector<uint8_t> rgb_;
};

}  // namespace kvwire::tools
