// config.json -> LlamaConfig.
#include "kvpress/llama/config.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "io/json_text.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>

namespace kvpress::llama {
namespace {

std::string read_text_file(const std::string& path, const char* who) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), who, ": cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Reads config.json's fields checked: "LlamaConfig: <origin>: <key> must be <expected>, got <value>".
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& j, const std::string& origin) : j_(j), origin_(origin) {}

  const nlohmann::json& json() const { return j_; }
  const std::string& origin() const { return origin_; }

  static bool has(const nlohmann::json& object, const char* key) {
    return object.contains(key) && !object[key].is_null();
  }
  bool has(const char* key) const { return has(j_, key); }

  [[noreturn]] void fail(const std::string& key, const char* expected, const nlohmann::json& value) const {
    std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (text.size() > 80) text = text.substr(0, 77) + "...";
    TORCH_CHECK(false, "LlamaConfig: ", origin_, ": ", key, " must be ", expected, ", got ", text);
  }
  int64_t get_int(const char* key) const {
    TORCH_CHECK(j_.contains(key) && j_[key].is_number_integer(), "LlamaConfig: ", origin_, ": ", key,
                " must be an integer");
    return j_[key].get<int64_t>();
  }
  // The sizes of the network: positive integers (past INT64_MAX they read as negative).
  int64_t get_size(const char* key) const {
    const int64_t value = get_int(key);
    if (value <= 0) fail(key, "a positive integer", j_[key]);
    return value;
  }
  int64_t opt_int(const char* key, int64_t fallback) const {
    return j_.contains(key) && j_[key].is_number_integer() ? j_[key].get<int64_t>() : fallback;
  }
  std::string opt_string(const nlohmann::json& object, const char* key, const char* fallback,
                         const std::string& path) const {
    if (!has(object, key)) return fallback;
    if (!object[key].is_string()) fail(path, "a string", object[key]);
    return object[key].get<std::string>();
  }
  bool opt_bool(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_boolean()) fail(key, "true or false", j_[key]);
    return j_[key].get<bool>();
  }
  // A finite number (integers included), or `fallback` when absent.
  double opt_number(const nlohmann::json& object, const char* key, double fallback, const std::string& path) const {
    if (!has(object, key)) return fallback;
    if (!object[key].is_number() || !std::isfinite(object[key].get<double>()))
      fail(path, "a finite number", object[key]);
    return object[key].get<double>();
  }

 private:
  const nlohmann::json& j_;
  const std::string& origin_;
};

// The model family, refusing what the runner does not implement (sliding windows, other
// activations, MLP biases).
std::string supported_model_type(const ConfigReader& r) {
  const nlohmann::json& j = r.json();
  const std::string model_type = r.opt_string(j, "model_type", "", "model_type");
  const bool qwen = model_type == "qwen2" || model_type == "qwen3";
  TORCH_CHECK(model_type == "llama" || model_type == "mistral" || qwen, "LlamaConfig: ", r.origin(),
              ": unsupported model_type '", model_type, "' (only \"llama\", \"mistral\", \"qwen2\" and \"qwen3\")");
  // Sliding-window attention (Mistral 7B v0.1; Qwen2/Qwen3 with use_sliding_window) is not
  // implemented: Mistral v0.2 onwards has sliding_window null, and Qwen's checkpoints ship with
  // use_sliding_window false (then transformers ignores sliding_window).
  if (model_type == "mistral" && r.has("sliding_window"))
    TORCH_CHECK(false, "LlamaConfig: ", r.origin(), ": sliding_window attention is not supported (sliding_window ",
                j["sliding_window"].dump().substr(0, 40), "; only null)");
  if (qwen && r.opt_bool("use_sliding_window", false))
    TORCH_CHECK(false, "LlamaConfig: ", r.origin(),
                ": use_sliding_window true is not supported (sliding-window layers)");
  if (r.has("layer_types")) {  // transformers 5 lists each layer's attention kind
    if (!j["layer_types"].is_array()) r.fail("layer_types", "a list", j["layer_types"]);
    for (const auto& kind : j["layer_types"])
      if (kind != "full_attention")
        r.fail("layer_types", "a list of \"full_attention\" (sliding windows are not supported)", kind);
  }
  const std::string act = r.opt_string(j, "hidden_act", "silu", "hidden_act");
  TORCH_CHECK(act == "silu", "LlamaConfig: ", r.origin(), ": unsupported hidden_act '", act, "' (only silu)");
  TORCH_CHECK(!r.opt_bool("mlp_bias", false), "LlamaConfig: ", r.origin(), ": mlp_bias is not supported");
  return model_type;
}

// Biases, norms, sizes, heads and token ids.
void read_shape(const ConfigReader& r, LlamaConfig& c) {
  const nlohmann::json& j = r.json();
  // Which projections have biases, as each family's attention module builds them: Llama, Mistral
  // and Qwen3 give all four attention_bias (Mistral has none); Qwen2 always q/k/v and never o_proj.
  const bool attention_bias = c.model_type != "mistral" && r.opt_bool("attention_bias", false);
  c.qkv_bias = c.model_type == "qwen2" || attention_bias;
  c.o_proj_bias = c.model_type != "qwen2" && attention_bias;
  c.qk_norm = c.model_type == "qwen3";
  c.vocab_size = r.get_size("vocab_size");
  c.hidden_size = r.get_size("hidden_size");
  c.intermediate_size = r.get_size("intermediate_size");
  c.num_layers = r.get_size("num_hidden_layers");
  c.num_heads = r.get_int("num_attention_heads");
  c.num_kv_heads = r.opt_int("num_key_value_heads", c.num_heads);
  TORCH_CHECK(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0, "LlamaConfig: ", r.origin(),
              ": num_attention_heads (", c.num_heads, ") must be a positive multiple of num_key_value_heads (",
              c.num_kv_heads, ")");
  // Absent head_dim: hidden_size / num_attention_heads, but Qwen3Config's default is 128.
  c.head_dim = j.contains("head_dim") && j["head_dim"].is_number_integer() ? j["head_dim"].get<int64_t>()
               : c.model_type == "qwen3"                                   ? 128
                                                                           : c.hidden_size / c.num_heads;
  TORCH_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, "LlamaConfig: ", r.origin(),
              ": head_dim must be positive and even, got ", c.head_dim);
  c.rms_norm_eps = r.opt_number(j, "rms_norm_eps", 1e-6, "rms_norm_eps");
  if (c.rms_norm_eps < 0) r.fail("rms_norm_eps", "a finite number >= 0", j["rms_norm_eps"]);
  c.max_position_embeddings = r.opt_int("max_position_embeddings", 0);
  if (c.max_position_embeddings < 0) r.fail("max_position_embeddings", "an integer >= 0", j["max_position_embeddings"]);
  c.tie_word_embeddings = r.opt_bool("tie_word_embeddings", false);
  c.bos_token_id = r.opt_int("bos_token_id", -1);
  c.eos_token_id = r.opt_int("eos_token_id", -1);
}

// RoPE: transformers 4 writes rope_theta + rope_scaling, transformers 5 rope_parameters.
void read_rope(const ConfigReader& r, LlamaConfig& c) {
  const nlohmann::json& j = r.json();
  const nlohmann::json* scaling = nullptr;
  std::string scaling_key;
  if (r.has("rope_scaling")) scaling = &j["rope_scaling"], scaling_key = "rope_scaling";
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    scaling = &j["rope_parameters"], scaling_key = "rope_parameters";
  c.rope_theta = r.opt_number(j, "rope_theta", 10000.0, "rope_theta");
  if (scaling) {
    if (!scaling->is_object()) r.fail(scaling_key, "an object or null", *scaling);
    const char* type_key = ConfigReader::has(*scaling, "rope_type") ? "rope_type" : "type";  // "type": < 4.45
    c.rope_type = r.opt_string(*scaling, type_key, "default", scaling_key + "." + type_key);
    TORCH_CHECK(c.rope_type == "default" || c.rope_type == "linear" || c.rope_type == "llama3",
                "LlamaConfig: ", r.origin(), ": unsupported RoPE scaling '", c.rope_type,
                "' (only default, linear and llama3)");
    c.rope_theta = r.opt_number(*scaling, "rope_theta", c.rope_theta, scaling_key + ".rope_theta");
    // The fields transformers requires for the type (it raises without them), each positive.
    auto required_positive = [&](const char* key) -> double {
      const std::string path = scaling_key + "." + key;
      TORCH_CHECK(ConfigReader::has(*scaling, key), "LlamaConfig: ", r.origin(), ": ", path, " is missing (RoPE type '",
                  c.rope_type, "' needs it)");
      const double value = r.opt_number(*scaling, key, 0.0, path);
      if (!(value > 0)) r.fail(path, "a finite number > 0", (*scaling)[key]);
      return value;
    };
    if (c.rope_type == "linear" || c.rope_type == "llama3") c.rope_factor = required_positive("factor");
    if (c.rope_type == "llama3") {
      c.rope_low_freq_factor = required_positive("low_freq_factor");
      c.rope_high_freq_factor = required_positive("high_freq_factor");
      const double original = required_positive("original_max_position_embeddings");
      if (original != std::floor(original))
        r.fail(scaling_key + ".original_max_position_embeddings", "an integer > 0",
               (*scaling)["original_max_position_embeddings"]);
      c.rope_original_max_position_embeddings = static_cast<int64_t>(original);
      // transformers divides by high - low: equal factors would make every band NaN.
      TORCH_CHECK(c.rope_high_freq_factor > c.rope_low_freq_factor, "LlamaConfig: ", r.origin(), ": ", scaling_key,
                  ".high_freq_factor (", c.rope_high_freq_factor, ") must be larger than low_freq_factor (",
                  c.rope_low_freq_factor, ")");
    }
  }
  if (c.rope_theta <= 0) r.fail("rope_theta", "a finite number > 0", nlohmann::json(c.rope_theta));
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const std::string& json_text, const std::string& origin) {
  const nlohmann::json j = io::parse_json(json_text, "LlamaConfig: " + origin);
  TORCH_CHECK(j.is_object(), "LlamaConfig: ", origin, ": expected a JSON object");
  const ConfigReader reader(j, origin);
  LlamaConfig c;
  c.model_type = supported_model_type(reader);
  read_shape(reader, c);
  read_rope(reader, c);
  return c;
}

LlamaConfig LlamaConfig::load(const std::string& path) { return from_json(read_text_file(path, "LlamaConfig"), path); }

}  // namespace kvpress::llama
