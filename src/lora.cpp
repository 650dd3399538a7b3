// PEFT LoRA adapters (include/kvpress/lora.h).
#include "kvpress/lora.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <regex>
#include <utility>

#include "checks.h"
#include "io/json_text.h"
#include "kvpress/io/safetensors.h"

namespace kvpress {
namespace {

constexpr const char* kWho = "LoraAdapter";

bool is_module(const std::string& module) {
  for (const char* m : LoraAdapter::kModules)
    if (module == m) return true;
  return false;
}

// A field that must be absent, null, false or empty for the adapters we apply.
bool unset(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return true;
  const nlohmann::json& v = config[key];
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) ||
         (v.is_array() && v.empty());
}

}  // namespace

void LoraAdapter::add(int64_t layer, const std::string& module, LoraLinear update) {
  TORCH_CHECK(layer >= 0, kWho, ".add: layer must be >= 0, got ", layer);
  TORCH_CHECK(is_module(module), kWho, ".add: module must be one of q_proj, k_proj, v_proj, o_proj, gate_proj, ",
              "up_proj, down_proj, got '", module, "'");
  TORCH_CHECK(update.a.defined() && update.b.defined() && update.a.dim() == 2 && update.b.dim() == 2 &&
                  update.a.size(0) > 0 && update.b.size(1) == update.a.size(0),
              kWho, ".add: layer ", layer, " ", module, ": A must be [r, in] and B [out, r] with r > 0, got ",
              update.a.defined() ? checks::shape_str(update.a) : "undefined", " and ",
              update.b.defined() ? checks::shape_str(update.b) : "undefined");
  TORCH_CHECK(std::isfinite(update.scaling), kWho, ".add: layer ", layer, " ", module, ": scaling must be finite, got ",
              update.scaling);
  update.a = update.a.to(at::kFloat).contiguous();  // PEFT keeps adapter weights in float32
  update.b = update.b.to(at::kFloat).contiguous();
  modules_[{layer, module}] = std::move(update);
}

const LoraLinear* LoraAdapter::find(int64_t layer, const std::string& module) const {
  const auto it = modules_.find({layer, module});
  return it == modules_.end() ? nullptr : &it->second;
}

LoraAdapter LoraAdapter::load_peft(const std::string& dir) {
  const std::string config_path = dir + "/adapter_config.json";
  const std::string where = std::string(kWho) + ": " + config_path;
  const nlohmann::json config = io::read_json_file(config_path, where);
  TORCH_CHECK(config.is_object(), where, ": expected a JSON object");
  TORCH_CHECK(config.value("peft_type", std::string()) == "LORA", where, ": peft_type must be \"LORA\", got ",
              config.contains("peft_type") ? config["peft_type"].dump() : "nothing");
  TORCH_CHECK(config.contains("r") && config["r"].is_number_integer() && config["r"].get<int64_t>() > 0, where,
              ": r must be a positive integer");
  TORCH_CHECK(config.contains("lora_alpha") && config["lora_alpha"].is_number(), where,
              ": lora_alpha must be a number");
  const double alpha = config["lora_alpha"].get<double>();
  const bool rslora = config.value("use_rslora", false);
  for (const char* key :
       {"use_dora", "lora_bias", "fan_in_fan_out", "alpha_pattern", "modules_to_save", "target_parameters",
        "trainable_token_indices", "use_qalora", "alora_invocation_tokens", "layer_replication", "arrow_config"})
    TORCH_CHECK(unset(config, key), where, ": ", key, " is not supported (got ", config[key].dump(), ")");
  TORCH_CHECK(config.value("bias", std::string("none")) == "none", where, ": bias must be \"none\", got ",
              config["bias"].dump());

  const std::string weights_path = dir + "/adapter_model.safetensors";
  const std::string weights_where = std::string(kWho) + ": " + weights_path;
  const io::SafetensorsFile file = io::load_safetensors(weights_path);
  // <prefix>layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
  static const std::regex kName(R"(^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$)");
  std::map<std::pair<int64_t, std::string>, std::pair<at::Tensor, at::Tensor>> pairs;
  for (const auto& [name, tensor] : file.tensors) {
    std::smatch m;
    TORCH_CHECK(std::regex_match(name, m, kName) && is_module(m[2].str()) && m[1].str().size() < 10, weights_where,
                ": unsupported tensor '", name,
                "' (LoRA A/B weights of the decoder layers' q/k/v/o_proj, gate/up/down_proj are)");
    auto& pair = pairs[{std::stoll(m[1].str()), m[2].str()}];
    (m[3].str() == "A" ? pair.first : pair.second) = tensor;
  }
  TORCH_CHECK(!pairs.empty(), weights_where, ": holds no LoRA weights");
  LoraAdapter adapter;
  for (const auto& [key, pair] : pairs) {
    const std::string what = "layers." + std::to_string(key.first) + " " + key.second;
    TORCH_CHECK(pair.first.defined() && pair.second.defined(), weights_where, ": ", what, " has lora_",
                pair.first.defined() ? "A" : "B", " but no lora_", pair.first.defined() ? "B" : "A");
    TORCH_CHECK(pair.first.dim() == 2 && pair.first.size(0) > 0, weights_where, ": ", what,
                " lora_A must be [r, in], got ", checks::shape_str(pair.first));
    const double rank = static_cast<double>(pair.first.size(0));  // the module's own r (rank_pattern)
    try {
      adapter.add(key.first, key.second, {pair.first, pair.second, rslora ? alpha / std::sqrt(rank) : alpha / rank});
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, weights_where, ": ", e.what_without_backtrace());
    }
  }
  return adapter;
}

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& weight, const LoraLinear* update,
                       const at::Tensor& bias) {
  const at::Tensor base = at::linear(x, weight, bias);
  if (update == nullptr) return base;
  // PEFT: the input cast to the adapter's dtype, result + B(A(x)) * scaling, back to the base dtype.
  const at::Tensor a = update->a.to(x.device()), b = update->b.to(x.device());
  const at::Tensor delta = at::linear(at::linear(x.to(a.scalar_type()), a), b) * update->scaling;
  return (base + delta).to(base.scalar_type());
}

}  // namespace kvpress
