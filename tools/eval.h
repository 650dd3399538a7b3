// `kvpress-cli eval`: perplexity and greedy agreement under compression on held-out stories with
// the kvpress::llama runner (docs/CLI.md, docs/EVAL.md).
#pragma once

#include <string>
#include <vector>

namespace kvpress_cli {

// Arguments after "eval". Returns the exit code; bad usage or input raises c10::Error (exit 2).
int run_eval(const std::vector<std::string>& args);

}  // namespace kvpress_cli
