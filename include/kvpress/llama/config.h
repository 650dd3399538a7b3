// Hyper-parameters of a Llama-family checkpoint, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>

namespace kvpress::llama {

struct LlamaConfig {
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

  // Parses config.json text. Supports the plain Llama architecture (model_type "llama", or
  // "mistral" without a sliding window; SiLU MLP, no biases) with RoPE of rope_type "default" (or rope_scaling null),
  // "linear" or "llama3", rope_theta at the top level or in transformers 5's rope_parameters. Anything else raises
  // c10::Error "LlamaConfig: <origin>: ..." naming the unsupported field.
  static LlamaConfig from_json(const std::string& json_text, const std::string& origin = "config.json");

  // Reads and parses `path` (a config.json file).
  static LlamaConfig load(const std::string& path);
};

}  // namespace kvpress::llama
