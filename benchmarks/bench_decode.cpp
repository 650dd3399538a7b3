// kvpress_bench_decode: greedy-decode speed (tokens/s, batch 1, float32, CPU) with the full KV
// cache versus a cache compressed by a press, at several context lengths, with the kvpress::llama
// runner. See benchmarks/README.md.
//
// Two models:
//   tiny    TinyStories-656K from the bundled checkpoint (2 layers, 8 query / 4 KV heads, head_dim
//           16); skipped when the model folder is not found (KVPRESS_MODELS);
//   random  a random-weight Llama built in-process through LlamaModel's (config, weights)
//           constructor: 8 layers, hidden 1024, 16 query / 4 KV heads, head_dim 64, MLP 2816,
//           vocabulary 8192 (about 100M parameters), so that attention over a long cache is a
//           visible part of a decode step.
//
// Each benchmark fills the cache with `context` tokens, of random keys and values (decode speed
// depends on the shapes only; filling through the model would take minutes at 8192 tokens on the
// random model), compresses every layer with KnormPress at `ratio` (0: full cache) — a cache
// whose position stays at `context` while it holds ratio-times fewer tokens, as after a prefill
// with a press — then times one decode step (one token through every layer, logits of the last
// position), rolling the cache back after each step so every step sees the same cache.
//
// Arguments: context length, ratio in percent. Counter tokens_per_second = decode steps / s.
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"

namespace {

namespace llama = kvpress::llama;

const llama::LlamaModel* tiny_model() {
  static std::optional<llama::LlamaModel> model = []() -> std::optional<llama::LlamaModel> {
    try {
      return llama::LlamaModel::load(llama::resolve_model_dir("tinystories-656k"));
    } catch (const c10::Error&) {
      return std::nullopt;
    }
  }();
  return model ? &*model : nullptr;
}

const llama::LlamaModel* random_model() {
  static const llama::LlamaModel model = [] {
    llama::LlamaConfig c;
    c.vocab_size = 8192;
    c.hidden_size = 1024;
    c.intermediate_size = 2816;
    c.num_layers = 8;
    c.num_heads = 16;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-5;
    c.max_position_embeddings = 16384;
    c.tie_word_embeddings = true;
    at::manual_seed(0);
    std::map<std::string, at::Tensor> w;
    auto randn = [](std::vector<int64_t> shape) { return at::randn(shape) * 0.02; };
    const int64_t h = c.hidden_size, d = c.head_dim, m = c.intermediate_size;
    w["model.embed_tokens.weight"] = randn({c.vocab_size, h});
    w["model.norm.weight"] = at::ones({h});
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      w[p + "input_layernorm.weight"] = at::ones({h});
      w[p + "post_attention_layernorm.weight"] = at::ones({h});
      w[p + "self_attn.q_proj.weight"] = randn({c.num_heads * d, h});
      w[p + "self_attn.k_proj.weight"] = randn({c.num_kv_heads * d, h});
      w[p + "self_attn.v_proj.weight"] = randn({c.num_kv_heads * d, h});
      w[p + "self_attn.o_proj.weight"] = randn({h, c.num_heads * d});
      w[p + "mlp.gate_proj.weight"] = randn({m, h});
      w[p + "mlp.up_proj.weight"] = randn({m, h});
      w[p + "mlp.down_proj.weight"] = randn({h, m});
    }
    return llama::LlamaModel(c, w);
  }();
  return &model;
}

void BM_Decode(benchmark::State& state, const llama::LlamaModel* (*get_model)()) {
  const llama::LlamaModel* model = get_model();
  if (model == nullptr) {
    state.SkipWithError("model not found (set KVPRESS_MODELS)");
    return;
  }
  c10::InferenceMode guard;
  const int64_t context = state.range(0);
  const double ratio = static_cast<double>(state.range(1)) / 100.0;
  const auto& c = model->config();

  // The cache: `context` tokens of random keys/values per layer, then compressed by KnormPress.
  at::manual_seed(1);
  llama::KVCache cache = model->new_cache();
  const auto press = kvpress::make_press("KnormPress", ratio);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const at::Tensor k = at::randn({1, c.num_kv_heads, context, c.head_dim});
    const at::Tensor v = at::randn({1, c.num_kv_heads, context, c.head_dim});
    if (ratio > 0.0) {
      kvpress::LayerInputs in;
      in.keys = k;
      in.values = v;
      in.num_heads = c.num_heads;
      in.layer_idx = l;
      in.num_layers = c.num_layers;
      const kvpress::KV kv = press->compress(in);
      cache.append(l, kv.keys, kv.values);
    } else {
      cache.append(l, k, v);
    }
  }
  cache.advance(context);
  const std::vector<int64_t> lengths = cache.lengths();
  const at::Tensor token = at::full({1, 1}, 1, at::kLong);
  llama::ForwardOptions options;
  options.last_logits_only = true;

  for (auto _ : state) {
    const at::Tensor logits = model->forward(token, cache, options).logits;
    benchmark::DoNotOptimize(logits.data_ptr());
    cache.truncate(lengths, context);  // roll back: every step decodes over the same cache
  }
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["cache_tokens"] = static_cast<double>(lengths[0]);
}

void Args(benchmark::internal::Benchmark* b) {
  for (int64_t context : {512, 2048, 8192})
    for (int64_t ratio : {0, 50, 75}) b->Args({context, ratio});
  b->ArgNames({"context", "ratio_pct"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK_CAPTURE(BM_Decode, tiny, tiny_model)->Apply(Args);
BENCHMARK_CAPTURE(BM_Decode, random, random_model)->Apply(Args);

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);  // one core: comparable across machines and runs (override: OMP_NUM_THREADS)
  if (const char* env = std::getenv("OMP_NUM_THREADS")) at::set_num_threads(std::max(1, std::atoi(env)));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
