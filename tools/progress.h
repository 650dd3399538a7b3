// A progress bar and durations for kvpress-cli's long commands (eval, bench).
#pragma once

#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvpress_cli {

inline std::string fmt_duration(double s) {
  if (s < 60) return fmt::format("{:.0f} s", s);
  return fmt::format("{}m{:02d}s", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
}

// A one-line progress bar on stderr, redrawn at most every 0.2 s, only when stderr is a terminal.
class Progress {
  using Clock = std::chrono::steady_clock;

 public:
  Progress(int64_t total, bool enabled) : total_(total), enabled_(enabled && isatty(STDERR_FILENO)) {}
  // `what`: the item under way, shown after the bar (cut to 40 characters).
  void step(int64_t done, const std::string& what = "") {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (done < total_ && now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double left = done > 0 ? elapsed * static_cast<double>(total_ - done) / static_cast<double>(done) : 0.0;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * done / std::max<int64_t>(total_, 1));
    fmt::print(stderr, "\r[{}{}] {}/{} runs, {} elapsed, ~{} left {:<40}", std::string(filled, '#'),
               std::string(kWidth - filled, '.'), done, total_, fmt_duration(elapsed), fmt_duration(left),
               what.substr(0, 40));
    std::fflush(stderr);
    drawn_ = true;
  }
  void finish() {
    if (drawn_) fmt::print(stderr, "\r{}\r", std::string(130, ' '));
  }

 private:
  int64_t total_;
  bool enabled_;
  bool drawn_ = false;
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_{};
};

}  // namespace kvpress_cli
