// Presses built by name so that they run, for the tests that walk the registry.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

#include "kvpress/io/safetensors.h"
#include "kvpress/presses/expected_attention_stats_press.h"
#include "kvpress/presses/lukv_press.h"
#include "kvpress/presses/qfilter_press.h"
#include "kvpress/presses/restorekv_press.h"
#include "kvpress/registry.h"
#include "kvpress/types.h"

namespace kvpress::testing {

// The model dimensions a press's files must match.
struct ModelShape {
  int64_t num_layers, num_heads, kv_heads, head_dim;
  int64_t hidden = 0;  // the hidden size (KVzapPress's surrogate input)
};

// Files of random model artifacts (seeded), written once per kind and shape and process into the
// temporary folder, removed at exit: QFilterPress's filters [L, Hkv, D] (a file) and
// ExpectedAttentionStatsPress's statistics (a folder with model.safetensors: query_mean [L, Hq, D],
// query_cov [L, Hq, D, D] positive semi-definite) and KVzapPress's surrogate (a folder with an MLP
// hidden -> 8 -> Hkv per layer, as KVzapModel.save_pretrained names its weights) and LUKVPress's
// budget curves (a file: prune fractions [99, L, Hkv] uniform in [0, 1)) and DuoAttentionPress's
// attention pattern (a folder: sink 4, recent 16, head scores uniform in [0, 1)) and FastKVzipPress's
// gates (a file: 16 dimensions, 4 sink keys per layer) and RestoreKVPress's restore folder (8
// restore embeddings and a PEFT LoRA adapter of rank 2 on every layer's q_proj and v_proj) and
// TriAttentionPress's query statistics (a file: [L, Hq, D / 2] each, the modulus mean above the mean's).
inline std::string random_artifact(const std::string& kind, const ModelShape& s) {
  // Removed with the C library at exit: std::filesystem there may resolve into libtorch's copy,
  // already torn down.
  struct Paths : std::map<std::string, std::string> {
    ~Paths() {
      for (const auto& [key, path] : *this) {
        for (const char* file :
             {"/model.safetensors", "/config.json", "/full_attention_heads.tsv", "/restore_embeddings.safetensors",
              "/adapter_config.json", "/adapter_model.safetensors"})
          std::remove((path + file).c_str());  // a folder's files
        std::remove(path.c_str());             // the file, or the emptied folder
      }
    }
  };
  static std::mutex mutex;
  static Paths written;
  const std::string shape = std::to_string(s.num_layers) + "x" + std::to_string(s.num_heads) + "x" +
                            std::to_string(s.kv_heads) + "x" + std::to_string(s.head_dim) + "x" +
                            std::to_string(s.hidden);
  std::lock_guard<std::mutex> lock(mutex);
  auto& path = written[kind + shape];
  if (!path.empty()) return path;
  const std::filesystem::path base = std::filesystem::temp_directory_path() /
                                     ("kvpress_tests_" + std::to_string(::getpid()) + "_" + kind + "_" + shape);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  if (kind == "q_filters") {
    path = base.string() + ".safetensors";
    io::save_safetensors(path, {{QFilterPress::kTensorName, at::randn({s.num_layers, s.kv_heads, s.head_dim}, gen)}});
  } else if (kind == "stats_folder") {
    path = base.string();
    std::filesystem::create_directories(path);
    const at::Tensor a = at::randn({s.num_layers, s.num_heads, s.head_dim, s.head_dim}, gen);
    io::save_safetensors(path + "/model.safetensors",
                         {{"query_mean", at::randn({s.num_layers, s.num_heads, s.head_dim}, gen)},
                          {"query_cov", at::matmul(a, a.transpose(-1, -2)) / static_cast<double>(s.head_dim)}});
  } else if (kind == "stats_file") {  // TriAttentionPress: query statistics [L, Hq, D / 2]
    path = base.string() + ".safetensors";
    const at::Tensor re = at::randn({s.num_layers, s.num_heads, s.head_dim / 2}, gen);
    const at::Tensor im = at::randn({s.num_layers, s.num_heads, s.head_dim / 2}, gen);
    io::save_safetensors(
        path, {{"q_mean_real", re},
               {"q_mean_imag", im},
               {"q_abs_mean", at::hypot(re, im) + at::rand({s.num_layers, s.num_heads, s.head_dim / 2}, gen)}});
  } else if (kind == "attention_pattern") {  // DuoAttentionPress: sink 4, recent 16, scores [L, Hkv]
    path = base.string();
    std::filesystem::create_directories(path);
    std::ofstream(path + "/config.json") << "{\"sink_size\": 4, \"recent_size\": 16}\n";
    std::ofstream tsv(path + "/full_attention_heads.tsv");
    const at::Tensor scores = at::rand({s.num_layers, s.kv_heads}, gen);
    for (int64_t l = 0; l < s.num_layers; ++l)
      for (int64_t h = 0; h < s.kv_heads; ++h) tsv << scores[l][h].item<double>() << (h + 1 < s.kv_heads ? '\t' : '\n');
  } else if (kind == "budget_curves") {  // LUKVPress: prune fractions [99, L, Hkv] in [0, 1)
    path = base.string() + ".safetensors";
    io::save_safetensors(
        path, {{LUKVPress::kTensorName, at::rand({LUKVPress::kCurveRatios, s.num_layers, s.kv_heads}, gen)}});
  } else if (kind == "gates") {  // FastKVzipPress
    path = base.string() + ".safetensors";
    const int64_t g = s.num_heads / s.kv_heads, o = 16;
    std::map<std::string, at::Tensor> weights;
    for (int64_t l = 0; l < s.num_layers; ++l) {
      const std::string layer = "layers." + std::to_string(l) + ".";
      weights[layer + "q_proj.weight"] = at::randn({s.kv_heads * g * o, s.hidden}, gen);
      weights[layer + "q_proj.bias"] = at::randn({s.kv_heads * g * o}, gen);
      weights[layer + "k_proj.weight"] = at::randn({s.kv_heads * o, s.hidden}, gen);
      weights[layer + "q_norm.weight"] = at::rand({o}, gen) + 0.5;
      weights[layer + "k_norm.weight"] = at::rand({o}, gen) + 0.5;
      weights[layer + "k_base"] = at::randn({s.kv_heads, 1, 4, o}, gen);
      weights[layer + "b"] = at::randn({s.kv_heads, 1, g}, gen);
    }
    io::save_safetensors(path, weights);
  } else if (kind == "restore") {  // RestoreKVPress: the authors' folder layout
    path = base.string();
    std::filesystem::create_directories(path);
    io::save_safetensors(path + "/" + RestoreKVPress::kEmbeddingsFile,
                         {{RestoreKVPress::kEmbeddingsKey, at::randn({8, s.hidden}, gen)}});
    std::ofstream(path + "/adapter_config.json") << R"({"peft_type": "LORA", "r": 2, "lora_alpha": 4})"
                                                 << "\n";
    std::map<std::string, at::Tensor> weights;
    for (int64_t l = 0; l < s.num_layers; ++l)
      for (const auto& [module, out] : {std::pair<const char*, int64_t>{"q_proj", s.num_heads * s.head_dim},
                                        std::pair<const char*, int64_t>{"v_proj", s.kv_heads * s.head_dim}}) {
        const std::string name = "base_model.model.model.layers." + std::to_string(l) + ".self_attn." + module;
        weights[name + ".lora_A.weight"] = at::randn({2, s.hidden}, gen) * 0.1;
        weights[name + ".lora_B.weight"] = at::randn({out, 2}, gen) * 0.1;
      }
    io::save_safetensors(path + "/adapter_model.safetensors", weights);
  } else {  // kvzap_model
    path = base.string();
    std::filesystem::create_directories(path);
    std::map<std::string, at::Tensor> weights;
    for (int64_t l = 0; l < s.num_layers; ++l) {
      const std::string layer = "layers." + std::to_string(l);
      weights[layer + ".0.weight"] = at::randn({8, s.hidden}, gen);
      weights[layer + ".0.bias"] = at::randn({8}, gen);
      weights[layer + ".2.weight"] = at::randn({s.kv_heads, 8}, gen);
      weights[layer + ".2.bias"] = at::randn({s.kv_heads}, gen);
    }
    io::save_safetensors(path + "/model.safetensors", weights);
  }
  return path;
}

// What `info`'s press needs beyond its defaults to run on layers of a model shaped `shape`: a seed
// where it draws random numbers (so that the same call gives the same answer; none if `seed` is
// empty), for its "path" parameters random files of that shape, and DMSPress a threshold (its
// default None cannot compress) and a window short enough to judge some tokens: its default inner
// KnormPress scores -||k||, which random keys of D dimensions put near -sqrt(D).
inline std::map<std::string, std::string> runnable_params(const PressInfo& info, const ModelShape& shape,
                                                          const std::string& seed = "1") {
  std::map<std::string, std::string> params;
  for (const PressParam& p : info.params) {
    if (p.name == "seed" && !seed.empty()) params["seed"] = seed;
    if (p.type == "path") params[p.name] = random_artifact(p.name, shape);
  }
  if (info.name == "DMSPress") {
    params["threshold"] = std::to_string(-std::sqrt(static_cast<double>(shape.head_dim)));
    params["sliding_window_size"] = "4";
  }
  return params;
}

// The same for layers shaped like `in` (its num_layers, query heads, KV heads and head dim).
inline std::map<std::string, std::string> runnable_params(const PressInfo& info, const LayerInputs& in,
                                                          const std::string& seed = "1") {
  const int64_t heads = in.num_heads > 0 ? in.num_heads : in.queries.defined() ? in.queries.size(1) : in.keys.size(1);
  const int64_t hidden = in.hidden_states.defined() ? in.hidden_states.size(-1) : 0;
  return runnable_params(info, {in.num_layers, heads, in.keys.size(1), in.keys.size(3), hidden}, seed);
}

}  // namespace kvpress::testing
