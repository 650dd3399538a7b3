// `kvpress-cli ask`: answers questions about a context file from one compressed cache, as kvpress's
// KVPressTextGenerationPipeline does (kvpress::llama::answer_questions). docs/CLI.md.
#pragma once

#include <string>
#include <vector>

namespace kvpress_cli {

// Arguments after "ask". Returns the exit code; bad usage or input raises (exit 2).
int run_ask(const std::vector<std::string>& args);

}  // namespace kvpress_cli
