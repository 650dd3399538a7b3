#include "kvpress/llama/stories.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <sstream>

#include "kvpress/llama/model.h"

namespace kvpress::llama {
namespace {

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(ws) - b + 1);
}

}  // namespace

std::vector<std::string> read_stories(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "read_stories: cannot open ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string all = ss.str(), sep = "<|endoftext|>";
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t hit = all.find(sep, pos);
    const std::string story = trim(all.substr(pos, hit == std::string::npos ? std::string::npos : hit - pos));
    if (!story.empty()) out.push_back(story);
    if (hit == std::string::npos) break;
    pos = hit + sep.size();
  }
  return out;
}

std::string default_stories_path() { return default_models_dir() + "/../data/tinystories_valid_100.txt"; }

}  // namespace kvpress::llama
