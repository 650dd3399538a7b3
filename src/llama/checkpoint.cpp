// Where checkpoints are found, and reading one (kvpress/llama/checkpoint.h).
#include "kvpress/llama/checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io/json_text.h"
#include "kvpress/llama/gguf.h"

namespace kvpress::llama {
namespace {

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "load_checkpoint: cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The .gguf files directly in `dir`.
std::vector<std::string> gguf_files(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (ends_with(name, ".gguf") && is_file(dir + "/" + name)) out.push_back(dir + "/" + name);
    }
    ::closedir(d);
  }
  return out;
}

// The checkpoint at `path` ("" when there is none): a Hugging Face folder, a .gguf file, or a
// folder holding one .gguf file.
std::string checkpoint_at(const std::string& path) {
  if (is_file(path) && ends_with(path, ".gguf")) return path;
  if (!is_dir(path)) return "";
  if (is_file(path + "/config.json")) return path;
  const std::vector<std::string> ggufs = gguf_files(path);
  TORCH_CHECK(ggufs.size() <= 1, "resolve_model: ", path, " holds ", ggufs.size(),
              " .gguf files and no config.json: pass the file you mean");
  return ggufs.empty() ? "" : ggufs.front();
}

// Where a name is looked for, in order: as given, then in the model folders.
std::vector<std::string> candidates(const std::string& name_or_path) {
  return {name_or_path, default_models_dir() + "/" + name_or_path, user_models_dir() + "/" + name_or_path};
}

// A Hugging Face folder's chat template: chat_template.jinja, else tokenizer_config.json's
// chat_template (a string, or a list of named templates: the one named "default").
std::string folder_chat_template(const std::string& dir) {
  if (is_file(dir + "/chat_template.jinja")) return read_text(dir + "/chat_template.jinja");
  const std::string config_path = dir + "/tokenizer_config.json";
  if (!is_file(config_path)) return "";
  const nlohmann::json config = io::parse_json(read_text(config_path), "load_checkpoint: " + config_path);
  if (!config.is_object() || !config.contains("chat_template")) return "";
  const nlohmann::json& t = config["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array())
    for (const auto& named : t)
      if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
          named["template"].is_string())
        return named["template"].get<std::string>();
  return "";
}

}  // namespace

std::string default_models_dir() {
  if (const char* env = std::getenv("KVPRESS_MODELS"); env && *env) return env;
  return KVPRESS_LLAMA_DEFAULT_MODELS_DIR;
}

std::string user_models_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/kvpress-cpp/models";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/kvpress-cpp/models";
}

std::string resolve_model_dir(const std::string& name_or_path) {
  TORCH_CHECK(!name_or_path.empty(), "resolve_model_dir: empty model name");
  const std::vector<std::string> places = candidates(name_or_path);
  for (const std::string& place : places)
    if (is_file(place + "/config.json")) return place;
  TORCH_CHECK(false, "resolve_model_dir: no config.json in '", places[0], "' nor in '", places[1], "' nor in '",
              places[2], "' (set KVPRESS_MODELS to the folder holding the models, or pass a model folder)");
}

std::string resolve_model(const std::string& name_or_path) {
  TORCH_CHECK(!name_or_path.empty(), "resolve_model: empty model name");
  const std::vector<std::string> places = candidates(name_or_path);
  for (const std::string& place : places)
    if (std::string found = checkpoint_at(place); !found.empty()) return found;
  TORCH_CHECK(false, "resolve_model: no checkpoint (a folder with config.json, or a .gguf file) at '", places[0],
              "' nor in '", places[1], "' nor in '", places[2],
              "' (scripts/setup.sh installs smollm2-135m-instruct; KVPRESS_MODELS names another models folder)");
}

Checkpoint load_checkpoint(const std::string& name_or_path, at::ScalarType dtype) {
  const std::string path = resolve_model(name_or_path);
  if (ends_with(path, ".gguf")) {
    GgufCheckpoint g = read_gguf_checkpoint(path);
    LlamaModel model(LlamaConfig::from_json(g.config_json, path), g.weights, dtype);
    g.weights.clear();  // the float32 copies go before the tokenizer is built
    return Checkpoint{path, std::move(model), Tokenizer::from_json(g.tokenizer_json, path), g.chat_template};
  }
  return Checkpoint{path, LlamaModel::load(path, dtype), Tokenizer::load(path + "/tokenizer.json"),
                    folder_chat_template(path)};
}

ChatTemplate chat_template_of(const Checkpoint& checkpoint) {
  const int64_t bos = checkpoint.model.config().bos_token_id;
  const std::string bos_token = bos >= 0 ? checkpoint.tokenizer.id_to_token(bos) : std::string();
  return ChatTemplate::recognize(checkpoint.chat_template, checkpoint.path, bos_token);
}

}  // namespace kvpress::llama
