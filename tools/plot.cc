#include "tools/plot.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire::tools {
namespace {

// 5x7 glyphs for ASCII 32..126, one byte per row, top row first; bit 4 is the leftmost
// column. Drawn for this file. g, p, q and y are drawn kDescent rows lower (see Drop).
constexpr uint8_t kFont[95][7] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // space
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04},  // !
    {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00},  // "
    {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A},  // #
    {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04},  // $
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // %
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D},  // &
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00},  // quote
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},  // (
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08},  // )
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00},  // *
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00},  // +
    {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08},  // ,
    {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00},  // -
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C},  // .
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // /
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E},  // 0
    {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 1
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F},  // 2
    {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},  // 3
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02},  // 4
    {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},  // 5
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E},  // 6
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // 7
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E},  // 8
    {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C},  // 9
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00},  // :
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08},  // ;
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02},  // <
    {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00},  // =
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08},  // >
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04},  // ?
    {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E},  // @
    {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // A
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E},  // B
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E},  // C
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C},  // D
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F},  // E
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10},  // F
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F},  // G
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // H
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // I
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C},  // J
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11},  // K
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F},  // L
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11},  // M
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},  // N
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // O
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10},  // P
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D},  // Q
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11},  // R
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E},  // S
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // T
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // U
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04},  // V
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A},  // W
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11},  // X
    {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04},  // Y
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F},  // Z
    {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E},  // [
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00},  // backslash
    {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E},  // ]
    {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00},  // ^
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F},  // _
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00},  // `
    {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F},  // a
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E},  // b
    {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E},  // c
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F},  // d
    {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E},  // e
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08},  // f
    {0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // g
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11},  // h
    {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E},  // i
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C},  // j
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12},  // k
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // l
    {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11},  // m
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11},  // n
    {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E},  // o
    {0x1E, 0x11, 0x11, 0x11, 0x1E, 0x10, 0x10},  // p
    {0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x01},  // q
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10},  // r
    {0x00, 0x00, 0x0F, 0x10, 0x0E, 0x01, 0x1E},  // s
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06},  // t
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D},  // u
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04},  // v
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A},  // w
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11},  // x
    {0x11, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // y
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F},  // z
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02},  // {
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // |
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08},  // }
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00},  // ~
};

constexpr Rgb kGrid{225, 225, 225};
constexpr Rgb kAxis{70, 70, 70};
constexpr Rgb kInk{30, 30, 30};

// Rows a glyph is drawn below the others: descenders borrow the gap between text lines
// instead of squashing the letter into the x-height.
int Drop(char ch) {
  return ch == 'g' || ch == 'p' || ch == 'q' || ch == 'y' ? Canvas::kDescent : 0;
}

const uint8_t* GlyphFor(char ch) {
  const int i = static_cast<unsigned char>(ch);
  return kFont[(i >= 32 && i <= 126 ? i : '?') - 32];
}

void Put32(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

void AppendChunk(std::vector<uint8_t>& out, const char type[5], const std::vector<uint8_t>& data) {
  Put32(out, static_cast<uint32_t>(data.size()));
  const size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  // The chunk CRC covers the type and the data, not the length.
  uLong crc = crc32(0L, out.data() + start, static_cast<uInt>(out.size() - start));
  Put32(out, static_cast<uint32_t>(crc));
}

// Tick positions in axis space (log2 of the value on a log2 axis) with their labels.
struct Ticks {
  std::vector<double> pos;
  std::vector<std::string> labels;
};

std::string Format(const char* fmt, double v, int decimals = 0) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), fmt, decimals, v);
  std::string out = buf;
  // "8e+07" -> "8e7": narrow tick labels matter more than printf's exponent form.
  for (const char* pad : {"e+0", "e+", "e-0"}) {
    if (size_t at = out.find(pad); at != std::string::npos) {
      out.replace(at, std::strlen(pad), pad[1] == '-' ? "e-" : "e");
    }
  }
  return out;
}

Ticks LinearTicks(double lo, double hi, bool log2_space) {
  Ticks t;
  std::vector<double> values = NiceTicks(lo, hi);
  const double step = values.size() > 1 ? values[1] - values[0] : 1.0;
  double biggest = 0;
  for (double v : values) biggest = std::max(biggest, std::abs(v));
  // Enough decimals to tell neighbouring ticks apart; %g once numbers get long.
  const bool general = biggest >= 1e6 || step < 1e-3;
  const int decimals = std::max(0, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
  for (double v : values) {
    if (log2_space && v <= 0) continue;
    t.pos.push_back(log2_space ? std::log2(v) : v);
    t.labels.push_back(general ? Format("%.*g", v, 3) : Format("%.*f", v, decimals));
  }
  return t;
}

// Powers of two on a log2 axis (32, 64, 128 ...); a range under an octave or two falls back
// to 1-2-5 ticks so the axis never goes bare.
Ticks Log2Ticks(double lo, double hi) {
  const int first = static_cast<int>(std::ceil(lo - 1e-9)), last = static_cast<int>(hi + 1e-9);
  if (last - first < 1) return LinearTicks(std::exp2(lo), std::exp2(hi), true);
  const int every = (last - first) / 8 + 1;
  Ticks t;
  for (int e = first; e <= last; e += every) {
    t.pos.push_back(e);
    t.labels.push_back(e >= 0 ? Format("%.*f", std::exp2(e), 0) : Format("%.*g", std::exp2(e), 6));
  }
  return t;
}

// Data range widened by `pad` of its span each side; a flat or single-valued range gets a
// span of its own so the mapping never divides by zero.
void PaddedRange(const std::vector<double>& v, double pad, double& lo, double& hi) {
  lo = 0, hi = 1;  // An empty panel still gets a drawable axis.
  if (!v.empty()) {
    const auto [mn, mx] = std::minmax_element(v.begin(), v.end());
    lo = *mn, hi = *mx;
  }
  if (hi - lo <= 1e-12 * std::max(std::abs(lo), std::abs(hi))) {
    const double half = lo != 0 ? std::abs(lo) * 0.1 : 1.0;
    lo -= half, hi += half;
  }
  const double span = hi - lo;
  lo -= span * pad, hi += span * pad;
}

bool Usable(double x, double y, bool log2_x) {
  return std::isfinite(x) && std::isfinite(y) && (!log2_x || x > 0);
}

// One canvas row of legend entries (short line + marker + name), wrapped to `max_width`.
struct LegendLayout {
  std::vector<std::vector<int>> rows;  // Entry indices per row.
  int width = 0;
};

constexpr int kSample = 22, kEntryGap = 16, kLegendRow = 16;

int EntryWidth(const std::string& name) { return kSample + 6 + Canvas::TextWidth(name); }

LegendLayout LayOutLegend(const std::vector<std::string>& names, int max_width) {
  LegendLayout l;
  int row_w = 0;
  for (int i = 0; i < static_cast<int>(names.size()); ++i) {
    const int w = EntryWidth(names[i]);
    if (l.rows.empty() || (row_w > 0 && row_w + kEntryGap + w > max_width)) {
      l.rows.emplace_back();
      row_w = 0;
    }
    row_w += (row_w > 0 ? kEntryGap : 0) + w;
    l.rows.back().push_back(i);
    l.width = std::max(l.width, row_w);
  }
  return l;
}

void DrawMarker(Canvas& c, int x, int y, Rgb colour) {
  c.Disc(x, y, 4, kWhite);  // A halo keeps markers readable where lines cross.
  c.Disc(x, y, 3, colour);
}

int NameIndex(const std::vector<std::string>& names, const std::string& name) {
  return static_cast<int>(std::find(names.begin(), names.end(), name) - names.begin());
}

void DrawPanel(Canvas& c, const Panel& p, int ox, int oy, int w, int h,
               const std::vector<std::string>& names) {
  std::vector<double> xs, ys;
  for (const Series& s : p.series) {
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!Usable(s.x[i], s.y[i], p.log2_x)) continue;
      xs.push_back(p.log2_x ? std::log2(s.x[i]) : s.x[i]);
      ys.push_back(s.y[i]);
    }
  }
  double xlo, xhi, ylo, yhi;
  PaddedRange(xs, 0.04, xlo, xhi);
  PaddedRange(ys, 0.08, ylo, yhi);
  const Ticks xt = p.log2_x ? Log2Ticks(xlo, xhi) : LinearTicks(xlo, xhi, false);
  const Ticks yt = LinearTicks(ylo, yhi, false);

  int ytick_w = 0;
  for (const std::string& l : yt.labels) ytick_w = std::max(ytick_w, Canvas::TextWidth(l));
  const int title_scale = Canvas::TextWidth(p.title, 2) <= w - 16 ? 2 : 1;
  const int left = 8 + (p.y_label.empty() ? 0 : Canvas::kGlyphH + 8) + ytick_w + 8;
  const int top = p.title.empty() ? 12 : 10 + Canvas::kGlyphH * title_scale + 10;
  const int bottom = 8 + Canvas::kGlyphH + (p.x_label.empty() ? 8 : 10 + Canvas::kGlyphH + 8);
  const int x0 = ox + left, x1 = ox + w - 18, y0 = oy + top, y1 = oy + h - bottom;
  auto px = [&](double v) {
    return x0 + static_cast<int>(std::lround((v - xlo) / (xhi - xlo) * (x1 - x0)));
  };
  auto py = [&](double v) {
    return y1 - static_cast<int>(std::lround((v - ylo) / (yhi - ylo) * (y1 - y0)));
  };

  c.Text(ox + (w - Canvas::TextWidth(p.title, title_scale)) / 2, oy + 10, p.title, kInk,
         title_scale);
  for (size_t i = 0; i < xt.pos.size(); ++i) {
    const int x = px(xt.pos[i]);
    c.Line(x, y0, x, y1, kGrid);
    c.Line(x, y1, x, y1 + 4, kAxis);
    c.Text(x - Canvas::TextWidth(xt.labels[i]) / 2, y1 + 8, xt.labels[i], kInk);
  }
  for (size_t i = 0; i < yt.pos.size(); ++i) {
    const int y = py(yt.pos[i]);
    c.Line(x0, y, x1, y, kGrid);
    c.Line(x0 - 4, y, x0, y, kAxis);
    c.Text(x0 - 8 - Canvas::TextWidth(yt.labels[i]), y - Canvas::kGlyphH / 2, yt.labels[i], kInk);
  }
  c.Rect(x0, y0, x1 - x0 + 1, y1 - y0 + 1, kAxis);
  c.Text((x0 + x1 - Canvas::TextWidth(p.x_label)) / 2, y1 + 8 + Canvas::kGlyphH + 10, p.x_label,
         kInk);
  c.TextUp(ox + 8, (y0 + y1 + Canvas::TextWidth(p.y_label)) / 2, p.y_label, kInk);

  // Lines first, then all markers, so no line is drawn over another series' marker.
  for (int pass = 0; pass < 2; ++pass) {
    for (const Series& s : p.series) {
      const Rgb colour = kPalette[NameIndex(names, s.name) % 10];
      bool have_prev = false;
      int prev_x = 0, prev_y = 0;
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (!Usable(s.x[i], s.y[i], p.log2_x)) {
          have_prev = false;  // A skipped point leaves a gap rather than a made-up segment.
          continue;
        }
        const int x = px(p.log2_x ? std::log2(s.x[i]) : s.x[i]), y = py(s.y[i]);
        if (pass == 0 && have_prev) c.Line(prev_x, prev_y, x, y, colour, 2);
        if (pass == 1) DrawMarker(c, x, y, colour);
        have_prev = true, prev_x = x, prev_y = y;
      }
    }
  }
}

absl::Status WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  // errno from the first step that failed; EIO where a short write left none.
  std::FILE* f = std::fopen(path.c_str(), "wb");
  int err = f == nullptr ? errno : 0;
  if (f != nullptr) {
    if (std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) err = errno ? errno : EIO;
    if (std::fclose(f) != 0 && err == 0) err = errno ? errno : EIO;
  }
  if (err == 0) return absl::OkStatus();
  const absl::StatusCode code = err == ENOENT || err == ENOTDIR ? absl::StatusCode::kNotFound
                                : err == EACCES || err == EPERM || err == EROFS
                                    ? absl::StatusCode::kPermissionDenied
                                : err == ENOSPC ? absl::StatusCode::kResourceExhausted
                                                : absl::StatusCode::kUnknown;
  return absl::Status(code, absl::StrCat("cannot write plot to ", path, ": ", std::strerror(err)));
}

}  // namespace

std::vector<double> NiceTicks(double lo, double hi, int target) {
  if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi) || target < 1) return {lo};
  const double raw = (hi - lo) / target;
  const int e = static_cast<int>(std::floor(std::log10(raw)));
  const double norm = raw / std::pow(10.0, e);
  const int m = norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10;
  // Tick k is k*m*10^e; dividing by an exact 10^-e keeps 0.6 from coming out 0.6000000000000001.
  const double scale = std::pow(10.0, std::abs(e));
  auto tick = [&](double k) { return e >= 0 ? k * m * scale : k * m / scale; };
  std::vector<double> ticks;
  for (double k = std::ceil(lo / tick(1) - 1e-9); tick(k) <= hi + tick(1) * 1e-9; ++k) {
    ticks.push_back(tick(k) + 0.0);  // + 0.0 turns -0 into 0.
  }
  return ticks;
}

Canvas::Canvas(int width, int height, Rgb background) : width_(width), height_(height) {
  KVWIRE_CHECK(width > 0 && height > 0);
  rgb_.resize(static_cast<size_t>(width) * height * 3);
  for (size_t i = 0; i < rgb_.size(); i += 3) {
    rgb_[i] = background.r, rgb_[i + 1] = background.g, rgb_[i + 2] = background.b;
  }
}

void Canvas::Set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
  p[0] = c.r, p[1] = c.g, p[2] = c.b;
}

Rgb Canvas::Get(int x, int y) const {
  KVWIRE_CHECK(x >= 0 && y >= 0 && x < width_ && y < height_);
  const uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
  return {p[0], p[1], p[2]};
}

void Canvas::FillRect(int x, int y, int w, int h, Rgb c) {
  for (int j = std::max(y, 0); j < std::min(y + h, height_); ++j) {
    for (int i = std::max(x, 0); i < std::min(x + w, width_); ++i) Set(i, j, c);
  }
}

void Canvas::Rect(int x, int y, int w, int h, Rgb c) {
  FillRect(x, y, w, 1, c);
  FillRect(x, y + h - 1, w, 1, c);
  FillRect(x, y, 1, h, c);
  FillRect(x + w - 1, y, 1, h, c);
}

void Canvas::Line(int x0, int y0, int x1, int y1, Rgb c, int thickness) {
  const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
  const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1, off = (thickness - 1) / 2;
  for (int err = dx + dy;;) {
    FillRect(x0 - off, y0 - off, thickness, thickness, c);
    if (x0 == x1 && y0 == y1) break;
    const int e2 = 2 * err;
    if (e2 >= dy) err += dy, x0 += sx;
    if (e2 <= dx) err += dx, y0 += sy;
  }
}

void Canvas::Disc(int cx, int cy, int radius, Rgb c) {
  for (int dy = -radius; dy <= radius; ++dy) {
    for (int dx = -radius; dx <= radius; ++dx) {
      if (dx * dx + dy * dy <= radius * radius + radius) Set(cx + dx, cy + dy, c);
    }
  }
}

void Canvas::Text(int x, int y, std::string_view s, Rgb c, int scale) {
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t* g = GlyphFor(s[i]);
    const int drop = Drop(s[i]);
    const int gx0 = x + static_cast<int>(i) * kAdvance * scale;
    for (int row = 0; row < kGlyphH; ++row) {
      for (int col = 0; col < kGlyphW; ++col) {
        if (g[row] >> (kGlyphW - 1 - col) & 1) {
          FillRect(gx0 + col * scale, y + (row + drop) * scale, scale, scale, c);
        }
      }
    }
  }
}

void Canvas::TextUp(int x, int y, std::string_view s, Rgb c, int scale) {
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t* g = GlyphFor(s[i]);
    const int drop = Drop(s[i]);
    const int along = static_cast<int>(i) * kAdvance;
    for (int row = 0; row < kGlyphH; ++row) {
      for (int col = 0; col < kGlyphW; ++col) {
        // Glyph top goes to the left, glyph left to the bottom.
        if (g[row] >> (kGlyphW - 1 - col) & 1) {
          FillRect(x + (row + drop) * scale, y - (along + col + 1) * scale, scale, scale, c);
        }
      }
    }
  }
}

int Canvas::TextWidth(std::string_view s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * kAdvance - 1) * scale;
}

std::vector<uint8_t> Canvas::EncodePng() const {
  const size_t stride = static_cast<size_t>(width_) * 3;
  std::vector<uint8_t> raw;
  raw.reserve(height_ * (stride + 1));
  for (int y = 0; y < height_; ++y) {
    raw.push_back(0);  // Filter type 0 (None): simple, and zlib still shrinks flat plots well.
    raw.insert(raw.end(), rgb_.begin() + y * stride, rgb_.begin() + (y + 1) * stride);
  }
  uLongf z_size = compressBound(raw.size());
  std::vector<uint8_t> z(z_size);
  // compress2 fails only on bad arguments or out of memory, both bugs here.
  KVWIRE_CHECK(compress2(z.data(), &z_size, raw.data(), raw.size(), 6) == Z_OK);
  z.resize(z_size);

  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> ihdr;
  Put32(ihdr, width_);
  Put32(ihdr, height_);
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8 bit, RGB, deflate, adaptive filters, no interlace.
  AppendChunk(png, "IHDR", ihdr);
  AppendChunk(png, "IDAT", z);
  AppendChunk(png, "IEND", {});
  return png;
}

absl::Status WritePng(const Figure& fig, const std::string& path) {
  if (fig.panels.empty()) return absl::InvalidArgumentError("plot has no panels");
  if (fig.panel_width < 160 || fig.panel_height < 120 || fig.panel_width > 4000 ||
      fig.panel_height > 4000) {
    return absl::InvalidArgumentError(absl::StrCat("plot panel size ", fig.panel_width, "x",
                                                   fig.panel_height,
                                                   " is outside 160x120 .. 4000x4000"));
  }
  std::vector<std::string> names;  // Legend order: first appearance across panels.
  for (const Panel& p : fig.panels) {
    for (const Series& s : p.series) {
      if (s.x.size() != s.y.size()) {
        return absl::InvalidArgumentError(absl::StrCat("plot series '", s.name, "' in panel '",
                                                       p.title, "' has ", s.x.size(), " x and ",
                                                       s.y.size(), " y values; expected equal"));
      }
      if (NameIndex(names, s.name) == static_cast<int>(names.size())) names.push_back(s.name);
    }
  }

  const int n = static_cast<int>(fig.panels.size());
  const int cols = std::min(n, 3), rows = (n + 2) / 3;
  const int width = cols * fig.panel_width;
  const int title_h = fig.title.empty() ? 0 : 16 + 2 * (Canvas::kGlyphH + Canvas::kDescent);
  const LegendLayout legend = LayOutLegend(names, width - 40);
  const int legend_h = names.empty() ? 0 : static_cast<int>(legend.rows.size()) * kLegendRow + 24;
  Canvas c(width, title_h + rows * fig.panel_height + legend_h);

  // Struck twice, 1 px apart: a bold figure title stands above the panel titles.
  for (int dx = 0; dx < 2; ++dx) {
    c.Text((width - Canvas::TextWidth(fig.title, 2)) / 2 + dx, 10, fig.title, kInk, 2);
  }
  for (int i = 0; i < n; ++i) {
    DrawPanel(c, fig.panels[i], (i % 3) * fig.panel_width, title_h + (i / 3) * fig.panel_height,
              fig.panel_width, fig.panel_height, names);
  }
  if (!names.empty()) {
    const int box_x = (width - legend.width) / 2 - 10, box_y = title_h + rows * fig.panel_height;
    c.Rect(box_x, box_y, legend.width + 20, legend_h - 8, kAxis);
    for (size_t r = 0; r < legend.rows.size(); ++r) {
      int x = box_x + 10;
      const int mid = box_y + 8 + static_cast<int>(r) * kLegendRow + kLegendRow / 2 - 1;
      for (int i : legend.rows[r]) {
        const Rgb colour = kPalette[i % 10];
        c.Line(x, mid, x + kSample - 1, mid, colour, 2);
        DrawMarker(c, x + kSample / 2, mid, colour);
        c.Text(x + kSample + 6, mid - Canvas::kGlyphH / 2, names[i], kInk);
        x += EntryWidth(names[i]) + kEntryGap;
      }
    }
  }
  return WriteFile(path, c.EncodePng());
}

}  // namespace kvwire::tools
