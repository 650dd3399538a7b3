// Held-out text for examples and evaluation: stories separated by "<|endoftext|>" lines
// (the format of ../shared/data/tinystories_valid_100.txt).
#pragma once

#include <string>
#include <vector>

namespace kvpress::llama {

// The stories of `path`, trimmed, empty ones dropped. Raises c10::Error if it cannot be read.
std::vector<std::string> read_stories(const std::string& path);

// <default_models_dir()>/../data/tinystories_valid_100.txt
std::string default_stories_path();

}  // namespace kvpress::llama
