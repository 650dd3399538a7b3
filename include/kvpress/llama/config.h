// Hyper-parameters of a Llama-family checkpoint, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>

namespace kvpress::llama {

struct LlamaConfig {
  // The family, as config.json's model_type: "llama", "mistral", "qwen2" or "qwen3". They share
  // Llama's computation but for the three switches below.
  std::string model_type = "llama";
  bool qkv_bias = false;     // q/k/v projections have biases (Qwen2; Llama and Qwen3 with attention_bias)
  bool o_proj_bias = false;  // o_proj has a bias (Llama and Qwen3 with attention_bias)
  bool qk_norm = false;      // per-head RMSNorm of queries and keys before RoPE (Qwen3's q_norm / k_norm)
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;    // num_hidden_layers
  int64_t num_heads = 0;     // num_attention_heads (query heads, Hq)
  int64_t num_kv_heads = 0;  // num_key_value_heads (Hkv; Hq % Hkv == 0)
  int64_t head_dim = 0;      // head_dim, else hidden_size / num_heads
  double rope_theta = 10000.0;
  // RoPE frequency scaling (rope_scaling, or transformers 5's rope_parameters): "default";
  // "linear" (every frequency divided by rope_factor); "llama3" (Llama 3.1's bands: wavelengths
  // beyond original_max_position_embeddings / low_freq_factor divided by rope_factor, below
  // original / high_freq_factor kept, the band between interpolated), as transformers computes it.
  std::string rope_type = "default";
  double rope_factor = 1.0;
  double rope_low_freq_factor = 0.0;                  // llama3
  double rope_high_freq_factor = 0.0;                 // llama3
  int64_t rope_original_max_position_embeddings = 0;  // llama3
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;  // informative: positions beyond it are computed anyway
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;  // -1 when the config has none
  int64_t eos_token_id = -1;

  // Parses config.json text. Supports model_type "llama" (attention_bias allowed, mlp_bias not),
  // "mistral" without a sliding window, "qwen2" (q/k/v biases) and "qwen3" (q/k norms,
  // attention_bias allowed), the last two without sliding-window layers; SiLU MLP; RoPE of
  // rope_type "default" (or rope_scaling null), "linear" or "llama3", rope_theta at the top level
  // or in transformers 5's rope_parameters. Absent fields take transformers' defaults for the
  // family (Qwen3's head_dim is 128). Anything else raises c10::Error "LlamaConfig: <origin>: ..."
  // naming the unsupported field.
  static LlamaConfig from_json(const std::string& json_text, const std::string& origin = "config.json");

  // Reads and parses `path` (a config.json file).
  static LlamaConfig load(const std::string& path);
};

}  // namespace kvpress::llama
