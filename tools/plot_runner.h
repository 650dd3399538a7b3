// Charts for kvpress-cli: run scripts/plot.py (matplotlib) with a Python interpreter.
#pragma once

#include <string>
#include <vector>

namespace kvpress_cli {

struct Plotter {
  std::string python;  // interpreter that can import matplotlib
  std::string script;  // plot.py
};

// Finds the interpreter ($KVPRESS_PYTHON, else the one CMake was configured with, else python3)
// and plot.py (installed next to the executable, else the source tree's), and checks that the
// interpreter imports matplotlib. Cheap (one short Python run): call it before long work.
// Raises c10::Error "<option> needs ..." when either is missing.
Plotter find_plotter(const std::string& option);

// Runs `python plot.py ARGS...` (no shell); raises c10::Error naming `option` when it fails.
void run_plotter(const Plotter& plotter, const std::vector<std::string>& args, const std::string& option);

}  // namespace kvpress_cli
