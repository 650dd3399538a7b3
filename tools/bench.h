// `kvpress-cli bench`: RULER-style long-context tasks (benchmarks/quality/make_tasks.py) answered by a
// real model through kvpress's pipeline with every press at every ratio; resumable JSON-lines
// results, a summary table, CSV and chart (docs/QUALITY.md, docs/CLI.md).
#pragma once

#include <string>
#include <vector>

namespace kvpress_cli {

// Arguments after "bench". Returns the exit code; bad usage or input raises (exit 2).
int run_bench(const std::vector<std::string>& args);

}  // namespace kvpress_cli
