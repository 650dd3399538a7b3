// config.json -> LlamaConfig, and where model folders are found.
#include "kvpress/llama/config.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "kvpress/llama/model.h"

namespace kvpress::llama {
namespace {

std::string read_text_file(const std::string& path, const char* who) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), who, ": cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const std::string& json_text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "LlamaConfig: ", origin, ": not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "LlamaConfig: ", origin, ": expected a JSON object");

  auto get_int = [&](const char* key) -> int64_t {
    TORCH_CHECK(j.contains(key) && j[key].is_number_integer(), "LlamaConfig: ", origin, ": ", key,
                " must be an integer");
    return j[key].get<int64_t>();
  };
  auto opt_int = [&](const char* key, int64_t fallback) -> int64_t {
    return j.contains(key) && j[key].is_number_integer() ? j[key].get<int64_t>() : fallback;
  };

  const std::string model_type = j.value("model_type", "");
  TORCH_CHECK(model_type == "llama", "LlamaConfig: ", origin, ": unsupported model_type '", model_type,
              "' (only \"llama\")");
  const std::string act = j.value("hidden_act", "silu");
  TORCH_CHECK(act == "silu", "LlamaConfig: ", origin, ": unsupported hidden_act '", act, "' (only silu)");
  TORCH_CHECK(!j.value("attention_bias", false), "LlamaConfig: ", origin, ": attention_bias is not supported");
  TORCH_CHECK(!j.value("mlp_bias", false), "LlamaConfig: ", origin, ": mlp_bias is not supported");

  LlamaConfig c;
  c.vocab_size = get_int("vocab_size");
  c.hidden_size = get_int("hidden_size");
  c.intermediate_size = get_int("intermediate_size");
  c.num_layers = get_int("num_hidden_layers");
  c.num_heads = get_int("num_attention_heads");
  c.num_kv_heads = opt_int("num_key_value_heads", c.num_heads);
  TORCH_CHECK(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0, "LlamaConfig: ", origin,
              ": num_attention_heads (", c.num_heads, ") must be a positive multiple of num_key_value_heads (",
              c.num_kv_heads, ")");
  c.head_dim = j.contains("head_dim") && j["head_dim"].is_number_integer() ? j["head_dim"].get<int64_t>()
                                                                           : c.hidden_size / c.num_heads;
  TORCH_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, "LlamaConfig: ", origin, ": head_dim must be even, got ",
              c.head_dim);
  c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
  c.max_position_embeddings = opt_int("max_position_embeddings", 0);
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.bos_token_id = opt_int("bos_token_id", -1);
  c.eos_token_id = opt_int("eos_token_id", -1);

  // RoPE: transformers 4 writes rope_theta + rope_scaling, transformers 5 rope_parameters.
  const nlohmann::json* scaling = nullptr;
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) scaling = &j["rope_scaling"];
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) scaling = &j["rope_parameters"];
  c.rope_theta = j.value("rope_theta", 10000.0);
  if (scaling) {
    const std::string type = scaling->value("rope_type", scaling->value("type", "default"));
    TORCH_CHECK(type == "default", "LlamaConfig: ", origin, ": unsupported RoPE scaling '", type,
                "' (only the default RoPE)");
    if (scaling->contains("rope_theta")) c.rope_theta = (*scaling)["rope_theta"].get<double>();
  }
  return c;
}

LlamaConfig LlamaConfig::load(const std::string& path) { return from_json(read_text_file(path, "LlamaConfig"), path); }

std::string default_models_dir() {
  if (const char* env = std::getenv("KVPRESS_MODELS"); env && *env) return env;
  return KVPRESS_LLAMA_DEFAULT_MODELS_DIR;
}

std::string resolve_model_dir(const std::string& name_or_path) {
  TORCH_CHECK(!name_or_path.empty(), "resolve_model_dir: empty model name");
  if (is_file(name_or_path + "/config.json")) return name_or_path;
  const std::string candidate = default_models_dir() + "/" + name_or_path;
  if (is_file(candidate + "/config.json")) return candidate;
  TORCH_CHECK(false, "resolve_model_dir: no config.json in '", name_or_path, "' nor in '", candidate,
              "' (set KVPRESS_MODELS to the folder holding the models, or pass a model folder)");
}

}  // namespace kvpress::llama
