// `kvpress-cli generate`: greedy continuations of several prompts with the kvpress::llama runner,
// dense (each prompt alone) or paged (continuous batching over one PagedKVCache). docs/CLI.md.
#pragma once

#include <string>
#include <vector>

namespace kvpress_cli {

// Arguments after "generate". Returns the exit code; bad usage or input raises (exit 2).
int run_generate(const std::vector<std::string>& args);

}  // namespace kvpress_cli
