// A small line-chart rasteriser writing PNG (RGB, zlib-compressed with the system zlib): enough for
// `kvpress-cli eval --png` without a plotting dependency. Text uses a built-in 5x7 pixel font
// (ASCII letters, digits and a few symbols; other characters are drawn as blanks).
#include "chart.h"

#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace kvpress_cli {
namespace {

// 5x7 glyphs, one string of 7 rows x 5 columns ('#' = ink), rows separated by spaces.
const std::map<char, const char*>& font() {
  static const std::map<char, const char*> glyphs = {
      {'A', ".###. #...# #...# ##### #...# #...# #...#"}, {'B', "####. #...# #...# ####. #...# #...# ####."},
      {'C', ".###. #...# #.... #.... #.... #...# .###."}, {'D', "####. #...# #...# #...# #...# #...# ####."},
      {'E', "##### #.... #.... ####. #.... #.... #####"}, {'F', "##### #.... #.... ####. #.... #.... #...."},
      {'G', ".###. #...# #.... #.### #...# #...# .####"}, {'H', "#...# #...# #...# ##### #...# #...# #...#"},
      {'I', ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###."}, {'J', "..### ...#. ...#. ...#. ...#. #..#. .##.."},
      {'K', "#...# #..#. #.#.. ##... #.#.. #..#. #...#"}, {'L', "#.... #.... #.... #.... #.... #.... #####"},
      {'M', "#...# ##.## #.#.# #.#.# #...# #...# #...#"}, {'N', "#...# #...# ##..# #.#.# #..## #...# #...#"},
      {'O', ".###. #...# #...# #...# #...# #...# .###."}, {'P', "####. #...# #...# ####. #.... #.... #...."},
      {'Q', ".###. #...# #...# #...# #.#.# #..#. .##.#"}, {'R', "####. #...# #...# ####. #.#.. #..#. #...#"},
      {'S', ".#### #.... #.... .###. ....# ....# ####."}, {'T', "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#.."},
      {'U', "#...# #...# #...# #...# #...# #...# .###."}, {'V', "#...# #...# #...# #...# #...# .#.#. ..#.."},
      {'W', "#...# #...# #...# #.#.# #.#.# #.#.# .#.#."}, {'X', "#...# #...# .#.#. ..#.. .#.#. #...# #...#"},
      {'Y', "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#.."}, {'Z', "##### ....# ...#. ..#.. .#... #.... #####"},
      {'a', "..... ..... .###. ....# .#### #...# .####"}, {'b', "#.... #.... #.##. ##..# #...# #...# ####."},
      {'c', "..... ..... .###. #.... #.... #...# .###."}, {'d', "....# ....# .##.# #..## #...# #...# .####"},
      {'e', "..... ..... .###. #...# ##### #.... .###."}, {'f', "..##. .#..# .#... ###.. .#... .#... .#..."},
      {'g', "..... .#### #...# #...# .#### ....# .###."}, {'h', "#.... #.... #.##. ##..# #...# #...# #...#"},
      {'i', "..#.. ..... .##.. ..#.. ..#.. ..#.. .###."}, {'j', "...#. ..... ..##. ...#. ...#. #..#. .##.."},
      {'k', "#.... #.... #..#. #.#.. ##... #.#.. #..#."}, {'l', ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###."},
      {'m', "..... ..... ##.#. #.#.# #.#.# #...# #...#"}, {'n', "..... ..... #.##. ##..# #...# #...# #...#"},
      {'o', "..... ..... .###. #...# #...# #...# .###."}, {'p', "..... ####. #...# #...# ####. #.... #...."},
      {'q', "..... .##.# #..## #...# .#### ....# ....#"}, {'r', "..... ..... #.##. ##..# #.... #.... #...."},
      {'s', "..... ..... .###. #.... .###. ....# ####."}, {'t', ".#... .#... ###.. .#... .#... .#..# ..##."},
      {'u', "..... ..... #...# #...# #...# #..## .##.#"}, {'v', "..... ..... #...# #...# #...# .#.#. ..#.."},
      {'w', "..... ..... #...# #...# #.#.# #.#.# .#.#."}, {'x', "..... ..... #...# .#.#. ..#.. .#.#. #...#"},
      {'y', "..... #...# #...# #...# .#### ....# .###."}, {'z', "..... ..... ##### ...#. ..#.. .#... #####"},
      {'0', ".###. #...# #..## #.#.# ##..# #...# .###."}, {'1', "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###."},
      {'2', ".###. #...# ....# ...#. ..#.. .#... #####"}, {'3', "####. ....# ....# .###. ....# ....# ####."},
      {'4', "...#. ..##. .#.#. #..#. ##### ...#. ...#."}, {'5', "##### #.... ####. ....# ....# #...# .###."},
      {'6', "..##. .#... #.... ####. #...# #...# .###."}, {'7', "##### ....# ...#. ..#.. .#... .#... .#..."},
      {'8', ".###. #...# #...# .###. #...# #...# .###."}, {'9', ".###. #...# #...# .#### ....# ...#. .##.."},
      {'.', "..... ..... ..... ..... ..... .##.. .##.."}, {',', "..... ..... ..... ..... .##.. ..#.. .#..."},
      {'-', "..... ..... ..... .###. ..... ..... ....."}, {'+', "..... ..#.. ..#.. ##### ..#.. ..#.. ....."},
      {'(', "...#. ..#.. .#... .#... .#... ..#.. ...#."}, {')', ".#... ..#.. ...#. ...#. ...#. ..#.. .#..."},
      {'=', "..... ..... ##### ..... ##### ..... ....."}, {'_', "..... ..... ..... ..... ..... ..... #####"},
      {'/', "....# ....# ...#. ..#.. .#... #.... #...."}, {':', "..... .##.. .##.. ..... .##.. .##.. ....."},
      {'%', "##..# ##..# ...#. ..#.. .#... #..## #..##"}
  };
  return glyphs;
}

using Rgb = std::array<uint8_t, 3>;

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  int width() const { return w_; }
  int height() const { return h_; }

  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c[0], p[1] = c[1], p[2] = c[2];
  }
  void rect(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  // A line `thick` pixels wide; every `dash` pixels on, `dash` off when dash > 0.
  void line(double x0, double y0, double x1, double y1, Rgb c, int thick = 1, int dash = 0) {
    const double len = std::hypot(x1 - x0, y1 - y0);
    const int steps = std::max(1, static_cast<int>(std::ceil(len * 2)));
    for (int i = 0; i <= steps; ++i) {
      const double t = static_cast<double>(i) / steps;
      if (dash > 0 && static_cast<int>(t * len / dash) % 2 == 1) continue;
      const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0)));
      const int y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
      const int lo = -(thick - 1) / 2, hi = thick / 2;
      rect(x + lo, y + lo, x + hi, y + hi, c);
    }
  }
  // Text at (x, y) = top-left, `scale` pixels per font pixel; returns the width drawn.
  int text(int x, int y, const std::string& s, Rgb c, int scale = 1, bool vertical = false) {
    int cx = 0;
    for (char ch : s) {
      const auto it = font().find(ch);
      if (it != font().end()) {
        const char* g = it->second;
        for (int row = 0; row < 7; ++row)
          for (int col = 0; col < 5; ++col)
            if (g[row * 6 + col] == '#')
              for (int dy = 0; dy < scale; ++dy)
                for (int dx = 0; dx < scale; ++dx) {
                  const int u = cx + col * scale + dx, v = row * scale + dy;
                  if (vertical) set(x + v, y - u, c);  // reads bottom to top
                  else set(x + u, y + v, c);
                }
      }
      cx += 6 * scale;
    }
    return cx;
  }
  static int text_width(const std::string& s, int scale = 1) { return static_cast<int>(s.size()) * 6 * scale; }

  std::vector<uint8_t> png() const {
    std::vector<uint8_t> raw;
    raw.reserve(static_cast<size_t>(h_) * (w_ * 3 + 1));
    for (int y = 0; y < h_; ++y) {
      raw.push_back(0);  // filter: none
      raw.insert(raw.end(), px_.begin() + static_cast<size_t>(y) * w_ * 3, px_.begin() + static_cast<size_t>(y + 1) * w_ * 3);
    }
    uLongf zlen = compressBound(static_cast<uLong>(raw.size()));
    std::vector<uint8_t> z(zlen);
    TORCH_CHECK(compress2(z.data(), &zlen, raw.data(), static_cast<uLong>(raw.size()), 9) == Z_OK, "PNG: zlib failed");
    z.resize(zlen);

    std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    auto be32 = [](std::vector<uint8_t>& v, uint32_t x) {
      for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<uint8_t>(x >> s));
    };
    auto chunk = [&](const char* type, const std::vector<uint8_t>& data) {
      be32(out, static_cast<uint32_t>(data.size()));
      std::vector<uint8_t> body(type, type + 4);
      body.insert(body.end(), data.begin(), data.end());
      out.insert(out.end(), body.begin(), body.end());
      be32(out, static_cast<uint32_t>(crc32(0L, body.data(), static_cast<uInt>(body.size()))));
    };
    std::vector<uint8_t> ihdr;
    be32(ihdr, static_cast<uint32_t>(w_));
    be32(ihdr, static_cast<uint32_t>(h_));
    ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, deflate, adaptive filtering, no interlace
    chunk("IHDR", ihdr);
    chunk("IDAT", z);
    chunk("IEND", {});
    return out;
  }

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
};

// "Nice" tick step for a range.
double tick_step(double span, int target) {
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

}  // namespace

void write_chart_png(const Chart& chart, const std::string& path, int width, int height) {
  // Palette: distinguishable colours (Tableau 10 order, then darker shades).
  static const Rgb colors[] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44},  {214, 39, 40},
                               {148, 103, 189}, {140, 86, 75}, {227, 119, 194}, {127, 127, 127},
                               {188, 189, 34},  {23, 190, 207}, {0, 0, 128},    {128, 0, 0},
                               {0, 100, 0},     {90, 90, 0}};
  const Rgb black{0, 0, 0}, grid{225, 225, 225}, grey{90, 90, 90};

  size_t legend_chars = chart.reference_label.size();
  for (const auto& s : chart.series) legend_chars = std::max(legend_chars, s.label.size());
  const int legend_w = static_cast<int>(legend_chars) * 6 + 40;
  Canvas c(width, height);
  const int left = 80, right = width - legend_w - 20, top = 50, bottom = height - 60;

  double xmin = 0.0, xmax = 0.0, ymin = chart.has_reference ? chart.reference : 1e300,
         ymax = chart.has_reference ? chart.reference : -1e300;
  for (const auto& s : chart.series) {
    for (double x : s.x) xmax = std::max(xmax, x);
    for (double y : s.y) ymin = std::min(ymin, y), ymax = std::max(ymax, y);
  }
  if (xmax <= xmin) xmax = xmin + 1;
  if (!(ymax > ymin)) ymin -= 0.5, ymax += 0.5;
  const double ypad = 0.05 * (ymax - ymin);
  ymin -= ypad, ymax += ypad;
  auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * (right - left); };
  auto py = [&](double y) { return bottom - (y - ymin) / (ymax - ymin) * (bottom - top); };

  // Grid, ticks and labels.
  const double xs = tick_step(xmax - xmin, 8), ys = tick_step(ymax - ymin, 8);
  for (double x = std::ceil(xmin / xs) * xs; x <= xmax + 1e-9; x += xs) {
    c.line(px(x), top, px(x), bottom, grid);
    const std::string t = fmt::format("{:g}", std::round(x / xs) * xs);
    c.text(static_cast<int>(px(x)) - Canvas::text_width(t) / 2, bottom + 8, t, black);
  }
  for (double y = std::ceil(ymin / ys) * ys; y <= ymax + 1e-9; y += ys) {
    c.line(left, py(y), right, py(y), grid);
    const std::string t = fmt::format("{:g}", std::round(y / ys) * ys);
    c.text(left - 8 - Canvas::text_width(t), static_cast<int>(py(y)) - 3, t, black);
  }
  c.line(left, top, left, bottom, black);
  c.line(left, bottom, right, bottom, black);
  c.line(right, top, right, bottom, black);
  c.line(left, top, right, top, black);
  c.text((left + right - Canvas::text_width(chart.title, 2)) / 2, 15, chart.title, black, 2);
  c.text((left + right - Canvas::text_width(chart.x_label)) / 2, bottom + 30, chart.x_label, black);
  c.text(15, (top + bottom + Canvas::text_width(chart.y_label)) / 2, chart.y_label, black, 1, true);

  // Reference line, then the series (thick lines, square markers).
  int ly = top + 5;
  const int lx = right + 15;
  if (chart.has_reference) {
    c.line(left, py(chart.reference), right, py(chart.reference), grey, 2, 6);
    c.line(lx, ly + 3, lx + 18, ly + 3, grey, 2, 4);
    c.text(lx + 24, ly, chart.reference_label, black);
    ly += 16;
  }
  for (size_t i = 0; i < chart.series.size(); ++i) {
    const auto& s = chart.series[i];
    const Rgb col = colors[i % (sizeof colors / sizeof colors[0])];
    for (size_t k = 0; k + 1 < s.x.size(); ++k) c.line(px(s.x[k]), py(s.y[k]), px(s.x[k + 1]), py(s.y[k + 1]), col, 2);
    for (size_t k = 0; k < s.x.size(); ++k) {
      const int x = static_cast<int>(std::lround(px(s.x[k]))), y = static_cast<int>(std::lround(py(s.y[k])));
      c.rect(x - 3, y - 3, x + 3, y + 3, col);
    }
    c.line(lx, ly + 3, lx + 18, ly + 3, col, 2);
    c.rect(lx + 6, ly, lx + 12, ly + 6, col);
    c.text(lx + 24, ly, s.label, black);
    ly += 16;
  }

  const std::vector<uint8_t> bytes = c.png();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  TORCH_CHECK(f != nullptr, "--png ", path, ": cannot create file");
  const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f);
  TORCH_CHECK(std::fclose(f) == 0 && written == bytes.size(), "--png ", path, ": write failed");
}

}  // namespace kvpress_cli
