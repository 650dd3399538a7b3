// LoRA adapters in PEFT's saved layout, for presses that run the model with an adapter
// (RestoreKVPress's restore pass, kvpress/presses/restorekv_press.h).
//
// A PEFT adapter folder (peft's save_pretrained, or a Hugging Face hub repository) holds
//   adapter_config.json        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": false, ...}
//   adapter_model.safetensors  base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight [r, in]
//                              base_model.model.model.layers.<i>.self_attn.q_proj.lora_B.weight [out, r]
// and an adapted linear layer computes, as PEFT's LoRA Linear at inference (no dropout):
//   y = x W^T + (x A^T) B^T * scaling,   scaling = lora_alpha / r   (use_rslora: lora_alpha / sqrt(r))
// with r the module's own rank (its A's rows, so PEFT's rank_pattern is honoured).
//
// Supported: the decoder layers' q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj.
// Refused, naming the file and the field: DoRA, LoRA biases, fan_in_fan_out, alpha_pattern,
// modules_to_save, other peft_types, and any other tensor (embedding or lm_head adapters).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

namespace kvpress {

// One linear layer's low-rank update.
struct LoraLinear {
  at::Tensor a;  // [r, in]
  at::Tensor b;  // [out, r]
  double scaling = 1.0;
};

class LoraAdapter {
 public:
  // The decoder-layer modules an adapter may target (Hugging Face Llama names).
  static constexpr const char* kModules[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                             "gate_proj", "up_proj", "down_proj"};

  LoraAdapter() = default;

  // Reads <dir>/adapter_config.json and <dir>/adapter_model.safetensors. Raises c10::Error
  // "LoraAdapter: <file>: <what is wrong>" on a missing file, an unsupported option or tensor, or
  // A/B shapes that do not chain ([r, in] and [out, r]).
  static LoraAdapter load_peft(const std::string& dir);

  // Adds one module's update (layer >= 0, module one of kModules). Raises on a bad name or shapes.
  void add(int64_t layer, const std::string& module, LoraLinear update);

  bool empty() const { return modules_.empty(); }
  // The update of `module` in `layer`, or nullptr where the adapter leaves that linear layer alone.
  const LoraLinear* find(int64_t layer, const std::string& module) const;
  // Every adapted (layer, module).
  const std::map<std::pair<int64_t, std::string>, LoraLinear>& modules() const { return modules_; }

 private:
  std::map<std::pair<int64_t, std::string>, LoraLinear> modules_;
};

// x W^T (+ bias when defined), plus the update's (x A^T) B^T * scaling when `update` is given (A
// and B cast to x's dtype and device). x [..., in], weight [out, in], bias [out] -> [..., out].
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& weight, const LoraLinear* update,
                       const at::Tensor& bias = at::Tensor());

}  // namespace kvpress
