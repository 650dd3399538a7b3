// Reading the parity fixtures written by tests/reference/make_fixtures.py (the pinned Python
// kvpress): manifest.json, one <case>.inputs.safetensors per captured layer and one
// <run>.safetensors per (press, parameters, ratio, input source). See tests/reference/README.md.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvpress/io/safetensors.h"
#include "kvpress/registry.h"
#include "kvpress/types.h"

namespace kvpress::testing {

// One kvpress run on one captured layer.
struct FixtureRun {
  std::string name;   // unique, e.g. "real_f32_l0__SnapKVPress_w16_k3_r0.5_attentions"
  std::string press;  // kvpress class name
  double compression_ratio = 0.0;
  std::map<std::string, std::string> params;  // kvpress parameter names, values as text
  // Inputs the C++ press gets besides keys/values:
  //   "keys" (nothing else), "attentions", "hidden_states" (+ q_proj, k_proj, cos, sin), "queries"
  //   (post-RoPE, every position), "rope" (cos, sin), "k_proj" (hidden_states, k_proj),
  //   "queries_rope" (queries, cos, sin), "queries_k_proj" (queries, hidden_states, k_proj),
  //   "keys_inv_freq" (inv_freq); "hidden_states" also gives inv_freq when the fixture has it.
  std::string source;
  std::string file;  // scores (float32 [B, Hkv, S]) and kept_indices (int64, ascending)
};

// One captured attention layer and the runs made on it.
struct FixtureCase {
  std::string name;
  std::string family;  // "real" or "random"
  std::string dtype;   // "float32" or "bfloat16"
  std::string inputs;  // file name of the inputs
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t seq_len = 0;
  int64_t layer_idx = 0;
  int64_t num_layers = 1;
  int64_t question_length = 0;  // the last positions playing the user's question (FinchPress)
  bool has_attentions = false;
  std::vector<FixtureRun> runs;
};

struct Manifest {
  std::string dir;
  std::string kvpress_version;
  std::string torch_version;
  std::string transformers_version;
  std::vector<FixtureCase> cases;
};

inline const char* fixtures_howto() {
  return "generate the parity fixtures with the pinned kvpress: "
         "`bash scripts/test.sh` does it, or by hand "
         "`source scripts/common.sh && kvpress_fixtures` (writes <build>/fixtures), or "
         "`<venv>/bin/python tests/reference/make_fixtures.py --out DIR`; then run the tests "
         "with KVPRESS_FIXTURES=DIR";
}

// The fixture directory: $KVPRESS_FIXTURES, else the build's default when the build defines
// KVPRESS_FIXTURES_DEFAULT_DIR (ctest's test discovery runs without the test environment),
// else "".
inline std::string fixtures_dir() {
  if (const char* env = std::getenv("KVPRESS_FIXTURES"); env && *env) return env;
#ifdef KVPRESS_FIXTURES_DEFAULT_DIR
  return KVPRESS_FIXTURES_DEFAULT_DIR;
#else
  return "";
#endif
}

// Parses DIR/manifest.json. Throws std::runtime_error saying what is missing and how to make it.
inline Manifest load_manifest(const std::string& dir) {
  if (dir.empty()) {
    throw std::runtime_error(std::string("KVPRESS_FIXTURES is not set; ") + fixtures_howto());
  }
  const std::string path = dir + "/manifest.json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("no parity manifest at " + path + "; " + fixtures_howto());
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    throw std::runtime_error("malformed parity manifest " + path + ": " + e.what());
  }
  Manifest m;
  m.dir = dir;
  m.kvpress_version = j.at("kvpress_version").get<std::string>();
  m.torch_version = j.value("torch_version", "");
  m.transformers_version = j.value("transformers_version", "");
  for (const auto& jc : j.at("cases")) {
    FixtureCase c;
    c.name = jc.at("name").get<std::string>();
    c.family = jc.at("family").get<std::string>();
    c.dtype = jc.at("dtype").get<std::string>();
    c.inputs = jc.at("inputs").get<std::string>();
    c.num_heads = jc.at("num_heads").get<int64_t>();
    c.num_kv_heads = jc.at("num_kv_heads").get<int64_t>();
    c.head_dim = jc.at("head_dim").get<int64_t>();
    c.seq_len = jc.at("seq_len").get<int64_t>();
    c.layer_idx = jc.at("layer_idx").get<int64_t>();
    c.num_layers = jc.at("num_layers").get<int64_t>();
    c.question_length = jc.value("question_length", int64_t{0});
    c.has_attentions = jc.at("has_attentions").get<bool>();
    for (const auto& jr : jc.at("runs")) {
      FixtureRun r;
      r.press = jr.at("press").get<std::string>();
      r.compression_ratio = jr.at("compression_ratio").get<double>();
      r.params = jr.at("params").get<std::map<std::string, std::string>>();
      r.source = jr.at("source").get<std::string>();
      r.file = jr.at("file").get<std::string>();
      r.name = jr.value("name", c.name + "__" + r.press + "_" + r.source);
      c.runs.push_back(std::move(r));
    }
    m.cases.push_back(std::move(c));
  }
  return m;
}

// The manifest of one generator's fixture folder (<fixtures>/<folder>/<manifest>), made by
// tests/reference/<script>. `error` says what is missing and how to make it; empty when loaded.
struct FolderFixtures {
  std::string dir, error;
  nlohmann::json manifest;
};
inline FolderFixtures load_folder_fixtures(const std::string& folder, const std::string& script,
                                           const std::string& manifest = "manifest.json") {
  FolderFixtures out;
  const std::string base = fixtures_dir();
  if (base.empty()) {
    out.error = std::string("KVPRESS_FIXTURES is not set; ") + fixtures_howto();
    return out;
  }
  out.dir = base + "/" + folder;
  std::ifstream in(out.dir + "/" + manifest);
  if (!in) {
    out.error = "no manifest at " + out.dir + "/" + manifest + "; generate it with tests/reference/" + script +
                " --out " + out.dir + " (scripts/test.sh does)";
    return out;
  }
  try {
    in >> out.manifest;
  } catch (const std::exception& e) {
    out.error = "malformed " + out.dir + "/" + manifest + ": " + e.what();
  }
  return out;
}

// Loads a fixture file once per process (every run of a case shares its inputs).
inline const io::SafetensorsFile& load_fixture_file(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<io::SafetensorsFile>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[path];
  if (!slot) slot = std::make_shared<io::SafetensorsFile>(io::load_safetensors(path));
  return *slot;
}

inline const at::Tensor& fixture_tensor(const io::SafetensorsFile& file, const std::string& key,
                                        const std::string& path) {
  const auto it = file.tensors.find(key);
  if (it == file.tensors.end()) throw std::runtime_error("fixture " + path + " has no tensor '" + key + "'");
  return it->second;
}

// A run's press parameters with the files they name (the registry's "path" parameters: QFilterPress's
// q_filters, ExpectedAttentionStatsPress's stats_folder), given relative to the fixture folder `dir`
// by the generators, as paths the press can open.
inline std::map<std::string, std::string> with_artifact_paths(const std::string& press,
                                                              std::map<std::string, std::string> params,
                                                              const std::string& dir) {
  const PressInfo* info = find_press(press);
  if (info == nullptr) return params;
  for (const PressParam& p : info->params) {
    auto it = params.find(p.name);
    if (p.type == "path" && it != params.end() && !it->second.empty() && it->second.front() != '/')
      it->second = dir + "/" + it->second;
  }
  return params;
}

// The LayerInputs a C++ caller would pass for `run.source`: keys and values always, plus only
// what that source names, so a press cannot silently fall back to another input.
inline LayerInputs make_layer_inputs(const Manifest& m, const FixtureCase& c, const FixtureRun& r) {
  const std::string path = m.dir + "/" + c.inputs;
  const io::SafetensorsFile& f = load_fixture_file(path);
  auto get = [&](const char* key) { return fixture_tensor(f, key, path); };
  LayerInputs in;
  in.keys = get("keys");
  in.values = get("values");
  in.num_heads = c.num_heads;
  in.layer_idx = c.layer_idx;
  in.num_layers = c.num_layers;
  in.question_length = c.question_length;
  if (r.source == "attentions") {
    in.attentions = get("attentions");
  } else if (r.source == "hidden_states") {
    in.hidden_states = get("hidden_states");
    in.q_proj = get("q_proj");
    in.k_proj = get("k_proj");
    in.cos = get("cos");
    in.sin = get("sin");
    if (f.tensors.count("inv_freq")) in.inv_freq = get("inv_freq");
  } else if (r.source == "keys_inv_freq") {
    in.inv_freq = get("inv_freq");
  } else if (r.source == "queries") {
    in.queries = get("queries");
  } else if (r.source == "rope") {
    in.cos = get("cos");
    in.sin = get("sin");
  } else if (r.source == "k_proj") {
    in.hidden_states = get("hidden_states");
    in.k_proj = get("k_proj");
  } else if (r.source == "queries_k_proj") {
    in.queries = get("queries");
    in.hidden_states = get("hidden_states");
    in.k_proj = get("k_proj");
  } else if (r.source == "queries_rope") {
    in.queries = get("queries");
    in.cos = get("cos");
    in.sin = get("sin");
  } else if (r.source != "keys") {
    throw std::runtime_error("run " + r.name + ": unknown source '" + r.source + "'");
  }
  return in;
}

}  // namespace kvpress::testing
