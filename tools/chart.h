// A small line chart written as a PNG (RGB, zlib via the system zlib), for `kvpress-cli eval --png`.
#pragma once

#include <string>
#include <vector>

namespace kvpress_cli {

struct ChartSeries {
  std::string label;
  std::vector<double> x, y;
};

struct Chart {
  std::string title, x_label, y_label;
  std::vector<ChartSeries> series;  // one colour each, with a legend entry
  bool has_reference = false;       // a dashed horizontal line, e.g. the full cache
  double reference = 0.0;
  std::string reference_label;
};

// Raises c10::Error when the file cannot be written.
void write_chart_png(const Chart& chart, const std::string& path, int width = 960, int height = 600);

}  // namespace kvpress_cli
