// kvpress_demo: every press of the registry on the real KV cache of TinyStories-656K reading a
// story (captured by tests/reference/make_fixtures.py), at ratios 0.25 / 0.5 / 0.75.
//
// For each press and ratio it compresses every layer and reports the tokens kept, the time spent
// compressing (all layers) and how much the attention output of the last 16 queries moves:
//   O = softmax(q K^T / sqrt(D)) V per query head, causal (query at position p sees the kept keys
//   whose original position is <= p), GQA (query head h reads KV head h / (Hq / Hkv)),
//   error = ||O_compressed - O_full||_F / ||O_full||_F over all layers together.
//
// Usage: kvpress_demo [--fixtures DIR] [--repeats N]
//   DIR defaults to $KVPRESS_FIXTURES, else the build tree's fixtures/ folder.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "kvpress/kvpress.h"

#ifndef KVPRESS_DEFAULT_FIXTURES
#define KVPRESS_DEFAULT_FIXTURES "fixtures"
#endif
#ifndef KVPRESS_SOURCE_DIR
#define KVPRESS_SOURCE_DIR "."
#endif

namespace {

using json = nlohmann::json;

constexpr int64_t kLastQueries = 16;
const double kRatios[] = {0.25, 0.5, 0.75};

struct Layer {
  kvpress::LayerInputs inputs;  // everything captured: a press uses what it needs
  at::Tensor last_queries;      // [B, Hq, 16, D] float32, post-RoPE
  at::Tensor query_positions;   // [16] int64
  at::Tensor full_output;       // [B, Hq, 16, D] float32
};

// Causal GQA attention of `q` (at positions qpos) over keys/values at positions kpos, in float32.
// q [B, Hq, n, D]; k, v [B, Hkv, m, D]; kpos [B, Hkv, m] or [m]. A query that sees no key gets 0.
at::Tensor attend(const at::Tensor& q, const at::Tensor& qpos, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& kpos) {
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), m = k.size(2), g = Hq / Hkv;
  // Query heads h = kv * g + j sit next to each other: view them as [B, Hkv, g * n, D].
  auto qg = q.to(at::kFloat).reshape({B, Hkv, g * n, D});
  auto scores = at::matmul(qg, k.to(at::kFloat).transpose(-1, -2)) / std::sqrt(double(D));
  auto qp = qpos.repeat({g}).view({1, 1, g * n, 1});
  auto kp = kpos.dim() == 1 ? kpos.view({1, 1, 1, m}) : kpos.view({B, Hkv, 1, m});
  scores.masked_fill_(kp > qp, -std::numeric_limits<float>::infinity());
  auto probs = at::softmax(scores, -1).nan_to_num(0.0);  // all-masked rows -> 0
  return at::matmul(probs, v.to(at::kFloat)).reshape({B, Hq, n, D});
}

std::string fixtures_dir(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--fixtures") return argv[i + 1];
  if (const char* env = std::getenv("KVPRESS_FIXTURES")) return env;
  return KVPRESS_DEFAULT_FIXTURES;
}

int repeats(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--repeats") return std::max(1, std::atoi(argv[i + 1]));
  return 5;
}

int missing_fixtures(const std::string& dir, const std::string& why) {
  std::fprintf(stderr,
               "kvpress_demo: no real-model fixtures in %s (%s).\n"
               "Create them with the pinned kvpress reference stack:\n"
               "  bash %s/scripts/demo.sh   # installs, builds, captures, runs this demo\n"
               "or\n"
               "  ~/.cache/kvpress-cpp/venv/bin/python %s/tests/reference/make_fixtures.py \\\n"
               "      --out %s --only real\n"
               "then run kvpress_demo [--fixtures DIR] (or set KVPRESS_FIXTURES).\n",
               dir.c_str(), why.c_str(), KVPRESS_SOURCE_DIR, KVPRESS_SOURCE_DIR, dir.c_str());
  return 1;
}

// A manifest field, looked up in the case itself, then in its "metadata" object.
const json* field(const json& c, const char* key) {
  if (c.contains(key)) return &c[key];
  if (c.contains("metadata") && c["metadata"].is_object() && c["metadata"].contains(key))
    return &c["metadata"][key];
  return nullptr;
}

template <typename T>
T get_or(const json& c, const char* key, T fallback) {
  const json* f = field(c, key);
  return f ? f->get<T>() : fallback;
}

std::string fmt_double(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: kvpress_demo [--fixtures DIR] [--repeats N]\n");
      return 0;
    }
  }
  const std::string dir = fixtures_dir(argc, argv);
  const int n_repeats = repeats(argc, argv);

  std::ifstream mf(dir + "/manifest.json");
  if (!mf) return missing_fixtures(dir, "manifest.json not found");
  json manifest;
  try {
    manifest = json::parse(mf);
  } catch (const std::exception& e) {
    return missing_fixtures(dir, std::string("manifest.json unreadable: ") + e.what());
  }
  const json& cases = manifest.contains("cases") ? manifest["cases"] : manifest;

  // The real model's float32 layers, in layer order.
  std::vector<const json*> real;
  for (const auto& c : cases) {
    if (get_or<std::string>(c, "family", "") != "real") continue;
    if (get_or<std::string>(c, "dtype", "float32") != "float32") continue;
    real.push_back(&c);
  }
  if (real.empty()) return missing_fixtures(dir, "manifest lists no float32 case of family \"real\"");
  std::stable_sort(real.begin(), real.end(), [](const json* a, const json* b) {
    return get_or<int64_t>(*a, "layer_idx", 0) < get_or<int64_t>(*b, "layer_idx", 0);
  });

  std::vector<Layer> layers;
  try {
    for (const json* c : real) {
      const std::string name = (*c)["name"].get<std::string>();
      auto file = kvpress::io::load_safetensors(
          dir + "/" + get_or<std::string>(*c, "inputs", name + ".inputs.safetensors"));
      auto& t = file.tensors;
      auto opt = [&](const char* k) { return t.count(k) ? t.at(k) : at::Tensor(); };
      Layer L;
      auto& in = L.inputs;
      in.keys = t.at("keys");
      in.values = t.at("values");
      in.queries = opt("queries");
      in.hidden_states = opt("hidden_states");
      in.q_proj = opt("q_proj");
      in.k_proj = opt("k_proj");
      in.attentions = opt("attentions");
      in.cos = opt("cos");
      in.sin = opt("sin");
      in.num_heads = get_or<int64_t>(*c, "num_heads", 0);
      in.layer_idx = get_or<int64_t>(*c, "layer_idx", 0);
      in.num_layers = get_or<int64_t>(*c, "num_layers", static_cast<int64_t>(real.size()));
      TORCH_CHECK(in.queries.defined(), "kvpress_demo: ", name, " has no queries");
      const int64_t S = in.keys.size(2);
      const int64_t n = std::min<int64_t>(kLastQueries, in.queries.size(2));
      L.last_queries = in.queries.narrow(2, in.queries.size(2) - n, n).to(at::kFloat);
      L.query_positions = at::arange(S - n, S, at::kLong);
      L.full_output = attend(L.last_queries, L.query_positions, in.keys, in.values,
                             at::arange(S, at::kLong));
      layers.push_back(std::move(L));
    }
  } catch (const std::exception& e) {
    return missing_fixtures(dir, std::string("cannot load: ") + e.what());
  }
  double full_sq = 0.0;
  for (const auto& L : layers) full_sq += L.full_output.pow(2).sum().item<double>();

  const auto& K0 = layers[0].inputs.keys;
  const int64_t B = K0.size(0), Hkv = K0.size(1), S = K0.size(2), D = K0.size(3);
  const int64_t Hq = kvpress::ops::num_query_heads(layers[0].inputs);
  const int64_t n_layers = static_cast<int64_t>(layers.size());
  const json& m0 = *real[0];
  std::printf("kvpress %s demo\nmodel: %s\n", KVPRESS_VERSION,
              get_or<std::string>(m0, "model", "TinyStories-656K (real trained Llama, HF layout)").c_str());
  if (const json* s = field(m0, "story"); s && s->is_string()) {
    std::string story = s->get<std::string>();
    if (story.size() > 100) story = story.substr(0, 97) + "...";
    std::printf("story: \"%s\" (%lld tokens)\n", story.c_str(), (long long)S);
  } else {
    std::printf("story: a held-out TinyStories validation story, %lld tokens\n", (long long)S);
  }
  std::printf("cache: %lld layers x [B=%lld, Hkv=%lld, S=%lld, D=%lld] float32, Hq=%lld, from %s\n",
              (long long)n_layers, (long long)B, (long long)Hkv, (long long)S, (long long)D,
              (long long)Hq, dir.c_str());
  std::printf("kept/head: tokens kept per KV head per layer; kept total: sum over %lld layers x %lld "
              "heads (full cache: %lld)\n",
              (long long)n_layers, (long long)Hkv, (long long)(n_layers * B * Hkv * S));
  std::printf("inputs: every press gets all captured inputs (post-RoPE queries of all positions, "
              "attentions, hidden states + projections, RoPE tables) and uses what it needs\n");
  std::printf("time: compressing all layers, median of %d runs; error: relative Frobenius error of "
              "the attention output of the last %lld queries, all layers\n\n",
              n_repeats, (long long)kLastQueries);

  const std::vector<std::string> header = {"press", "ratio", "kept/head", "kept total", "time ms",
                                           "attn error"};
  std::vector<std::vector<std::string>> rows;
  for (const auto& info : kvpress::list_presses()) {
    for (double ratio : kRatios) {
      std::vector<std::string> row = {info.name, fmt_double("%.2f", ratio)};
      try {
        // Seeded presses (RandomPress) get a fixed seed so the table is reproducible.
        std::map<std::string, std::string> params;
        for (const auto& p : info.params)
          if (p.name == "seed") params["seed"] = "42";
        auto press = kvpress::make_press(info.name, ratio, params);
        std::vector<kvpress::KV> out(layers.size());
        for (size_t l = 0; l < layers.size(); ++l) out[l] = press->compress(layers[l].inputs);  // warm-up
        std::vector<double> times;
        for (int r = 0; r < n_repeats; ++r) {
          auto t0 = std::chrono::steady_clock::now();
          for (size_t l = 0; l < layers.size(); ++l) out[l] = press->compress(layers[l].inputs);
          times.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
        int64_t kept_total = 0, kept_min = INT64_MAX, kept_max = 0;
        double diff_sq = 0.0;
        for (size_t l = 0; l < layers.size(); ++l) {
          const int64_t n = out[l].keys.size(2);
          kept_total += B * Hkv * n;
          kept_min = std::min(kept_min, n);
          kept_max = std::max(kept_max, n);
          auto o = attend(layers[l].last_queries, layers[l].query_positions, out[l].keys,
                          out[l].values, out[l].kept_indices);
          diff_sq += (o - layers[l].full_output).pow(2).sum().item<double>();
        }
        row.push_back(kept_min == kept_max ? std::to_string(kept_min)
                                           : std::to_string(kept_min) + "-" + std::to_string(kept_max));
        row.push_back(std::to_string(kept_total));
        row.push_back(fmt_double("%.3f", times[times.size() / 2]));
        row.push_back(fmt_double("%.4f", std::sqrt(diff_sq / full_sq)));
      } catch (const c10::Error& e) {
        std::string msg = e.what_without_backtrace();
        msg = msg.substr(0, msg.find('\n'));
        row.push_back("error: " + msg);
      }
      rows.push_back(std::move(row));
    }
  }

  // Aligned table: text left, numbers right; an error message spans the remaining columns.
  std::vector<size_t> width(header.size());
  for (size_t i = 0; i < header.size(); ++i) width[i] = header[i].size();
  for (const auto& r : rows)
    if (r.size() == header.size())
      for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  auto print_row = [&](const std::vector<std::string>& r) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      const bool left = i == 0 || (r.size() != header.size() && i + 1 == r.size());
      const size_t pad = i < width.size() && r[i].size() < width[i] ? width[i] - r[i].size() : 0;
      if (i) line += "  ";
      line += left ? r[i] + (i + 1 == r.size() ? "" : std::string(pad, ' ')) : std::string(pad, ' ') + r[i];
    }
    std::printf("%s\n", line.c_str());
  };
  print_row(header);
  size_t total_width = 0;
  for (size_t w : width) total_width += w + 2;
  std::printf("%s\n", std::string(total_width - 2, '-').c_str());
  std::string last_press;
  for (const auto& r : rows) {
    if (!last_press.empty() && r[0] != last_press) std::printf("\n");
    last_press = r[0];
    print_row(r);
  }
  return 0;
}
