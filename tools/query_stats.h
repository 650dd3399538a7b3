// `kvpress-cli query-stats`: a model's pre-RoPE query statistics over a calibration text, the file
// TriAttentionPress reads (its stats_file). docs/CLI.md.
#pragma once

#include <string>
#include <vector>

namespace kvpress_cli {

// Arguments after "query-stats". Returns the exit code; bad usage or input raises (exit 2).
int run_query_stats(const std::vector<std::string>& args);

}  // namespace kvpress_cli
