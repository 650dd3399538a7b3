// Issue 36, item 2: the Llama runner over tensor-parallel ranks (kvpress/llama/tensor_parallel.h).
// Each rank (a thread of this process with its own Gloo group member) runs its shard of
// tinystories-656k: its KV heads and MLP block, partial outputs summed over the ranks, its own
// PagedKVCache of its heads. Continuous batching over 2 and 4 ranks gives every prompt the tokens,
// and the logits within float32 summation-order rounding, of one process; presses compress each
// rank's heads, with global budgets as one process would. kvpress-cli generate --tp N runs the
// same as separate processes (tests/cli/test_cli.sh).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "distributed_layer.h"
#include "kvpress/llama/kvzip.h"
#include "kvpress/llama/llama.h"
#include "kvpress/llama/tensor_parallel.h"
#include "kvpress/presses/decoding_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/kvgrad_press.h"
#include "kvpress/registry.h"
#include "runnable_press.h"
#include "test_util.h"
#include "tiny_model.h"

namespace kvpress {
namespace {

using distributed::BudgetMode;
using llama::LlamaModel;

const LlamaModel& model() { return testing::tiny_model(); }

// Three prompts of different lengths (BOS first), seeded, drawn once (ranks are threads); max_batch 2
// makes the third wait for pages.
const std::vector<std::vector<int64_t>>& prompts() {
  static const std::vector<std::vector<int64_t>> out = [] {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(5);
    std::vector<std::vector<int64_t>> drawn;
    for (int64_t n : {90, 70, 120}) {
      const at::Tensor ids = at::randint(3, 2000, {n}, generator, at::kLong);
      std::vector<int64_t> p(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + n);
      p[0] = 1;
      drawn.push_back(p);
    }
    return drawn;
  }();
  return out;
}

struct RankGeneration {
  llama::PagedGenerations generations;
  std::map<std::pair<int64_t, int64_t>, at::Tensor> logits;  // (prompt, step)
  std::string error;
};

llama::PagedGenerationOptions options(const BasePress* press) {
  llama::PagedGenerationOptions opt;
  opt.press = press;
  opt.max_new_tokens = 10;
  opt.stop_at_eos = false;
  opt.max_batch = 2;
  opt.page_size = 8;
  return opt;
}

RankGeneration generate(const LlamaModel& m, const BasePress* press) {
  RankGeneration run;
  llama::PagedGenerationOptions opt = options(press);
  opt.on_logits = [&](int64_t prompt, int64_t step, const at::Tensor& logits) {
    run.logits[{prompt, step}] = logits.clone();
  };
  run.generations = llama::generate_paged(m, prompts(), opt);
  return run;
}

// What every rank of `world` returned from body(rank, its shard) (ranks as threads, each with its own
// Gloo group member and its shard of the model with `budgets`), or the c10::Error it raised: [rank].
template <typename T>
struct OnRanks {
  std::vector<T> values;
  std::vector<std::string> errors;  // "" where the rank returned
};
template <typename Body>
auto on_ranks(int world, BudgetMode budgets, Body&& body) {
  using T = std::invoke_result_t<Body&, int, const LlamaModel&>;
  const testing::TemporaryFolder dir("kvpress_tp");
  OnRanks<T> out{std::vector<T>(static_cast<size_t>(world)), std::vector<std::string>(static_cast<size_t>(world))};
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto group = distributed::gloo_group(dir.file("store"), rank, world, std::chrono::seconds(60));
        out.values[static_cast<size_t>(rank)] = body(rank, llama::tensor_parallel_shard(model(), group, budgets));
      } catch (const c10::Error& e) {
        out.errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
      }
    });
  for (auto& t : ranks) t.join();
  return out;
}

// Every rank of `world` generates over its shard: [rank].
std::vector<RankGeneration> tensor_parallel_runs(int world, BudgetMode budgets, const BasePress* press) {
  OnRanks<RankGeneration> runs =
      on_ranks(world, budgets, [&](int, const LlamaModel& shard) { return generate(shard, press); });
  for (int rank = 0; rank < world; ++rank)
    runs.values[static_cast<size_t>(rank)].error = runs.errors[static_cast<size_t>(rank)];
  return runs.values;
}

TEST(TensorParallel, ContinuousBatchingOverRanksGivesOneProcesssTokens) {
  // No press; per-head presses (the same in both modes); presses whose scores or budgets span heads
  // (TOVAPress's mean over heads, AdaKVPress's layer budget), which global budgets exchange.
  // Presses compressing while decoding too: every rank's hook compacts its heads at the same steps.
  struct Case {
    std::string name;
    BudgetMode budgets;
    double ratio;
    std::map<std::string, std::string> params;
  };
  const std::vector<Case> cases = {
      {"none", BudgetMode::kGlobal, 0.0, {}},
      {"SnapKVPress", BudgetMode::kPerRank, 0.5, {}},
      {"KnormPress", BudgetMode::kGlobal, 0.5, {}},
      {"TOVAPress", BudgetMode::kGlobal, 0.5, {}},
      {"AdaKVPress", BudgetMode::kGlobal, 0.5, {}},
      {"DecodingPress",
       BudgetMode::kGlobal,
       0.0,
       {{"compression_interval", "4"}, {"target_size", "60"}, {"press", "SnapKVPress"}, {"press.window_size", "4"}}},
      {"CompressionRatioDecodingPress",
       BudgetMode::kGlobal,
       0.3,
       {{"compression_interval", "3"}, {"press", "KnormPress"}}},
      {"PrefillDecodingPress",
       BudgetMode::kGlobal,
       0.0,
       {{"prefilling_press", "StreamingLLMPress"},
        {"prefilling_press.compression_ratio", "0.5"},
        {"decoding_press", "DecodingPress"},
        {"decoding_press.compression_interval", "3"},
        {"decoding_press.target_size", "50"}}}};
  for (const Case& c : cases) {
    const std::string& name = c.name;
    const BudgetMode budgets = c.budgets;
    const std::shared_ptr<const BasePress> press = name == "none" ? nullptr : make_press(name, c.ratio, c.params);
    const RankGeneration one = generate(model(), press.get());
    for (int world : {2, 4}) {
      SCOPED_TRACE(name + " over " + std::to_string(world) + " ranks, " + distributed::budget_mode_name(budgets));
      const std::vector<RankGeneration> ranks = tensor_parallel_runs(world, budgets, press.get());
      for (int rank = 0; rank < world; ++rank) {
        const RankGeneration& r = ranks[static_cast<size_t>(rank)];
        ASSERT_EQ(r.error, "") << "rank " << rank;
        ASSERT_EQ(r.generations.generations.size(), 3u);
        for (size_t p = 0; p < 3; ++p)
          EXPECT_EQ(r.generations.generations[p].tokens, one.generations.generations[p].tokens)
              << "rank " << rank << ", prompt " << p;
        // The same admissions and steps: every rank ran the same schedule as one process.
        EXPECT_EQ(r.generations.stats.decode_steps, one.generations.stats.decode_steps);
        EXPECT_EQ(r.generations.stats.prefill_batches, one.generations.stats.prefill_batches);
        // Each rank's cache holds its heads: 1/world of one process's pages (per-head budgets
        // round per head, so within one page per head and layer).
        EXPECT_EQ(r.generations.stats.prompt_pages_uncompressed * world,
                  one.generations.stats.prompt_pages_uncompressed);
        // Logits: float32 sums over ranks in another order than one process's (o_proj's and
        // down_proj's partial outputs): within 1e-4 of logits of magnitude ~10.
        ASSERT_EQ(r.logits.size(), one.logits.size());
        for (const auto& [key, logits] : one.logits)
          EXPECT_TRUE(at::allclose(r.logits.at(key), logits, 1e-4, 1e-4))
              << "rank " << rank << ", prompt " << key.first << ", step " << key.second << ": max difference "
              << (r.logits.at(key) - logits).abs().max().item<float>();
      }
      // Every rank computes the same logits (the all-reduce gives every rank the same sums).
      for (int rank = 1; rank < world; ++rank)
        for (const auto& [key, logits] : ranks[0].logits)
          EXPECT_TRUE(at::equal(ranks[static_cast<size_t>(rank)].logits.at(key), logits)) << "rank " << rank;
    }
  }
}

// Each head's kept count in every layer after a prefill with `press`: [layer][head].
std::vector<std::vector<int64_t>> kept_per_head(const LlamaModel& m, const BasePress& press) {
  llama::KVCache cache = m.new_cache();
  llama::PrefillOptions opt;
  opt.press = &press;
  opt.tokenizer = &testing::tiny_tokenizer();  // KVzipPress's repeat prompt
  m.prefill(at::tensor(at::ArrayRef<int64_t>(prompts()[0]), at::kLong).unsqueeze(0), cache, opt);
  std::vector<std::vector<int64_t>> out;
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    if (!cache.is_ragged(l)) {
      out.emplace_back(static_cast<size_t>(m.config().num_kv_heads), cache.length(l));
      continue;
    }
    const at::Tensor lengths = cache.ragged(l).lengths()[0].contiguous();
    out.emplace_back(lengths.data_ptr<int64_t>(), lengths.data_ptr<int64_t>() + lengths.numel());
  }
  return out;
}

// Second passes on shards (the dense runner), global budgets over 2 and 4 ranks: each rank runs the
// pass over its heads (its forwards summed over the ranks) and the budgets are set over every rank's
// heads, so every rank keeps what one process keeps of its heads: each head's kept count equals one
// process's for that head, and the tokens are the same.
// - KVComposePress structured (k_l) and unstructured (k_{l,g}): the mean over heads and the composite
//   curves by all-reduce, the per-head ranking by all-gather (KVComposeSession::share_heads).
// - KVzipPress (evictions over every layer and head; layerwise: over each layer's heads),
//   FastKVzipPress (its gates' rows of each rank's heads), RestoreKVPress (its restore tokens
//   through the LoRA adapter cut as the shard's weights) and KVgradPress (gradients through the
//   ranks' sums): the scores gathered for the selection.
// - LayerDefensiveKVPress: each layer's DefensiveKV scores (window bias, value-norm shares and
//   maximum over every rank's heads), then the selection across layers over the gathered scores.
TEST(TensorParallel, SecondPassesBudgetOverEveryRanksHeads) {
  const std::string gates = testing::random_artifact("gates", {2, 8, 4, 16, 128});
  const std::string restore = testing::random_artifact("restore", {2, 8, 4, 16, 128});
  const std::vector<std::pair<std::string, std::shared_ptr<const BasePress>>> cases = {
      {"KVCompose structured", make_press("KVComposePress", 0.5, {{"structured", "true"}})},
      {"KVCompose unstructured", make_press("KVComposePress", 0.5, {{"structured", "false"}})},
      {"KVzip", make_press("KVzipPress", 0.5, {{"chunk_size", "40"}})},
      {"KVzip layerwise", make_press("KVzipPress", 0.5, {{"layerwise", "true"}, {"kvzip_plus_normalization", "true"}})},
      {"FastKVzip", make_press("FastKVzipPress", 0.5, {{"gates", gates}})},
      {"RestoreKV", make_press("RestoreKVPress", 0.5, {{"restore", restore}})},
      {"KVgrad", make_press("KVgradPress", 0.5, {{"chunk_size", "40"}})},
      {"LayerDefensiveKV", make_press("LayerDefensiveKVPress", 0.5, {{"window_size", "16"}})}};
  for (const auto& test_case : cases) {
    // Named, not structured bindings: C++17 lambdas (the ranks' bodies) cannot capture those.
    const std::string& label = test_case.first;
    const std::shared_ptr<const BasePress>& press = test_case.second;
    SCOPED_TRACE(label);
    llama::GenerationOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = 8;
    opt.stop_at_eos = false;
    opt.tokenizer = &testing::tiny_tokenizer();
    const llama::Generation one = llama::generate_greedy(model(), prompts()[0], {}, opt);
    const std::vector<std::vector<int64_t>> one_kept = kept_per_head(model(), *press);
    for (int world : {2, 4}) {
      // Each rank's greedy tokens and its heads' kept counts.
      const auto runs = on_ranks(world, BudgetMode::kGlobal, [&](int, const LlamaModel& shard) {
        return std::pair{llama::generate_greedy(shard, prompts()[0], {}, opt).tokens, kept_per_head(shard, *press)};
      });
      for (int rank = 0; rank < world; ++rank) {
        ASSERT_EQ(runs.errors[static_cast<size_t>(rank)], "") << "rank " << rank << " of " << world;
        const auto& [tokens, kept] = runs.values[static_cast<size_t>(rank)];
        EXPECT_EQ(tokens, one.tokens) << "rank " << rank << " of " << world;
        const int64_t heads = 4 / world;
        for (size_t l = 0; l < one_kept.size(); ++l) {
          const std::vector<int64_t> mine(one_kept[l].begin() + rank * heads, one_kept[l].begin() + (rank + 1) * heads);
          EXPECT_EQ(kept[l], mine) << "rank " << rank << " of " << world << ", layer " << l;
        }
      }
    }
    if (label != "KVCompose structured")  // heads of a layer keep different counts
      EXPECT_NE(*std::min_element(one_kept[0].begin(), one_kept[0].end()),
                *std::max_element(one_kept[0].begin(), one_kept[0].end()));
  }
}

// KVgradPress's scores need gradients through the shard's forward: the ranks' sums of partial
// projections pass the gradient to each rank's part, and each rank's q/k/v and gate/up inputs get the
// sum over the ranks of their parts' gradients. Every rank's scores of its heads equal one process's
// (float32 sums in another order: within 1e-4 relative), holding the full cache or recomputing it.
TEST(TensorParallel, KVgradScoresThroughTheRanksSumsAsOneProcess) {
  const KVgradPress press(0.5, false, 4, 40);
  const at::Tensor ids = at::tensor(at::ArrayRef<int64_t>(prompts()[0]), at::kLong).unsqueeze(0);
  for (const bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute_context" : "full cache");
    KVgradRunOptions run;
    run.recompute_context = recompute;
    const auto scores_of = [&](const LlamaModel& m) {
      llama::KVCache cache = m.new_cache();
      return llama::kvgrad_prefill(m, ids, cache, press, testing::tiny_tokenizer(), {}, run).scores;
    };
    const at::Tensor one = scores_of(model());  // [L, Hkv, N]
    for (int world : {2, 4}) {
      const auto runs =
          on_ranks(world, BudgetMode::kGlobal, [&](int, const LlamaModel& shard) { return scores_of(shard); });
      const std::vector<at::Tensor>& scores = runs.values;
      const std::vector<std::string>& errors = runs.errors;
      const int64_t heads = 4 / world;
      for (int rank = 0; rank < world; ++rank) {
        ASSERT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank << " of " << world;
        const at::Tensor mine = one.narrow(1, rank * heads, heads);
        EXPECT_TRUE(at::allclose(scores[static_cast<size_t>(rank)], mine, 1e-4, 1e-7))
            << "rank " << rank << " of " << world << ": max relative difference "
            << ((scores[static_cast<size_t>(rank)] - mine).abs() / mine.abs().clamp_min(1e-7)).max().item<float>();
      }
    }
  }
}

// A LoRA adapter on every projection of a layer (A's columns of o_proj and down_proj, B's rows of
// the others, cut with the shard's weights) gives every rank the layer's output of one process, over
// 2 and 4 ranks; an adapter shaped for the shard's own weights is refused, naming the whole shapes.
TEST(TensorParallel, ALoraAdapterAppliesOnShardsAsOnTheWholeModel) {
  static const auto drawn = [] {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(9);
    const llama::LlamaConfig& c = model().config();
    const int64_t hidden = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
    const int64_t inter = c.intermediate_size;
    LoraAdapter adapter;
    for (const auto& [module, out, in] : {std::tuple{"q_proj", q, hidden},
                                          {"k_proj", kv, hidden},
                                          {"v_proj", kv, hidden},
                                          {"o_proj", hidden, q},
                                          {"gate_proj", inter, hidden},
                                          {"up_proj", inter, hidden},
                                          {"down_proj", hidden, inter}})
      adapter.add(1, module, {at::randn({2, in}, generator) * 0.1, at::randn({out, 2}, generator), 2.0});
    return std::pair{adapter, at::randn({1, 12, model().config().hidden_size}, generator)};
  }();
  const LoraAdapter& adapter = drawn.first;  // named: the lambdas below capture them
  const at::Tensor& x = drawn.second;
  // Layer 1's output of the residual stream x at positions 0..11.
  const auto layer_output = [&](const LlamaModel& m, const LoraAdapter* lora) {
    const LayerQKV qkv = m.layer_qkv(1, x, m.rope(0, x.size(1)), lora);
    return m.layer_output(1, x, m.layer_attention(qkv.q, qkv.k, qkv.v), lora);
  };
  const at::Tensor one = layer_output(model(), &adapter);
  ASSERT_GT((one - layer_output(model(), nullptr)).abs().max().item<float>(), 0.1);  // the adapter matters
  for (int world : {2, 4}) {
    const auto runs = on_ranks(world, BudgetMode::kGlobal, [&](int, const LlamaModel& shard) {
      shard.check_adapter(adapter, "test");
      return layer_output(shard, &adapter);
    });
    const std::vector<at::Tensor>& outputs = runs.values;
    const std::vector<std::string>& errors = runs.errors;
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank << " of " << world;
      EXPECT_TRUE(at::allclose(outputs[static_cast<size_t>(rank)], one, 1e-4, 1e-4))
          << "rank " << rank << " of " << world << ": max difference "
          << (outputs[static_cast<size_t>(rank)] - one).abs().max().item<float>();
    }
  }
}

// A greedy generation on the dense runner, kept with its cache: prompts()[0] prefilled with `press`,
// then kDenseSteps tokens, each forward compressing with it (a decoding press) as generate_greedy.
constexpr int64_t kDenseSteps = 10;
struct DenseRun {
  std::vector<int64_t> tokens;
  std::optional<llama::KVCache> cache;
};
DenseRun dense_generation(const LlamaModel& m, const BasePress& press) {
  DenseRun run;
  run.cache.emplace(m.new_cache());
  const std::unique_ptr<PressSequenceState> state = new_sequence_state_of(&press);
  llama::PrefillOptions prefill;
  prefill.press = &press;
  prefill.press_state = state.get();
  prefill.last_logits_only = true;
  const at::Tensor ids = at::tensor(at::ArrayRef<int64_t>(prompts()[0]), at::kLong).unsqueeze(0);
  at::Tensor logits = m.prefill(ids, *run.cache, prefill).logits;
  llama::ForwardOptions step;
  step.last_logits_only = true;
  step.press = &press;
  step.press_state = state.get();
  for (int64_t i = 0; i < kDenseSteps; ++i) {
    run.tokens.push_back(logits[0][logits.size(1) - 1].argmax().item<int64_t>());
    logits = m.forward(at::tensor({run.tokens.back()}, at::kLong).unsqueeze(0), *run.cache, step).logits;
  }
  return run;
}

// Each KV head's cached tokens in `layer`: [Hkv] int64 (head-ragged layers and keep masks counted).
at::Tensor tokens_per_head(const llama::KVCache& cache, int64_t layer) {
  if (cache.is_ragged(layer)) return cache.ragged(layer).lengths()[0];
  const at::Tensor mask = cache.keep_mask(layer);
  const int64_t heads = cache.keys(layer).size(1), length = cache.length(layer);
  return mask.defined() ? mask[0].sum(-1).to(at::kLong) : at::full({heads}, length, at::kLong);
}

// Presses that compress while decoding, on the dense runner over 2 and 4 ranks with global budgets:
// DMSPress evicting per head as tokens leave its window, CAMPress keeping the top of the scores
// averaged over every rank's heads and merging evicted values (its merges drawn once for every head,
// by rank 0, from the default generator seeded as the one process's). Every rank's tokens equal one
// process's, every head keeps as many tokens, and its keys and values equal one process's for that
// head (within the float32 rounding of the summed projections).
TEST(TensorParallel, DecodingEvictionsAndMergesAsOneProcess) {
  const std::vector<std::pair<const char*, std::map<std::string, std::string>>> cases = {
      {"DMSPress", {{"threshold", "-3"}, {"decoding", "true"}, {"sliding_window_size", "16"}}},
      {"CAMPress", {{"target_size", "48"}, {"compression_interval", "3"}}}};
  for (const auto& [name, params] : cases) {
    SCOPED_TRACE(name);
    const std::shared_ptr<const BasePress> press = make_press(name, 0.0, params);
    at::manual_seed(11);  // CAMPress's merges; ranks (threads) never touch the generator but through rank 0
    const DenseRun one = dense_generation(model(), *press);
    for (int world : {2, 4}) {
      at::manual_seed(11);
      const auto runs = on_ranks(world, BudgetMode::kGlobal,
                                 [&](int, const LlamaModel& shard) { return dense_generation(shard, *press); });
      const int64_t heads = 4 / world;
      for (int rank = 0; rank < world; ++rank) {
        const DenseRun& run = runs.values[static_cast<size_t>(rank)];
        ASSERT_EQ(runs.errors[static_cast<size_t>(rank)], "") << "rank " << rank << " of " << world;
        EXPECT_EQ(run.tokens, one.tokens) << "rank " << rank << " of " << world;
        for (int64_t l = 0; l < one.cache->num_layers(); ++l) {
          SCOPED_TRACE("rank " + std::to_string(rank) + " of " + std::to_string(world) + ", layer " +
                       std::to_string(l));
          EXPECT_TRUE(
              at::equal(tokens_per_head(*run.cache, l), tokens_per_head(*one.cache, l).narrow(0, rank * heads, heads)));
          if (run.cache->is_ragged(l)) continue;
          EXPECT_TRUE(
              at::allclose(run.cache->values(l), one.cache->values(l).narrow(1, rank * heads, heads), 1e-4, 1e-4));
          EXPECT_TRUE(at::allclose(run.cache->keys(l), one.cache->keys(l).narrow(1, rank * heads, heads), 1e-4, 1e-4));
        }
      }
    }
    // Not vacuous: the press compressed while decoding (DMSPress: heads keep different counts).
    const at::Tensor kept = tokens_per_head(*one.cache, 0);
    EXPECT_LT(kept.max().item<int64_t>(), static_cast<int64_t>(prompts()[0].size()) + kDenseSteps);
    if (std::string(name) == "DMSPress") EXPECT_NE(kept.min().item<int64_t>(), kept.max().item<int64_t>());
  }
}

// A rank that stops part-way (here: it raises from its on_logits after the third step and leaves
// the group) makes the other fail at its next all-reduce with an error naming it, never wait.
TEST(TensorParallel, ARankThatLeavesMakesTheOtherFailNotWait) {
  const testing::TemporaryFolder dir("kvpress_tp_leave");
  std::vector<std::string> errors(2);
  std::vector<double> seconds(2);
  std::vector<std::thread> ranks;
  const auto start = std::chrono::steady_clock::now();
  for (int rank = 0; rank < 2; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto group = distributed::gloo_group(dir.file("store"), rank, 2, std::chrono::seconds(20));
        const LlamaModel shard = llama::tensor_parallel_shard(model(), group, BudgetMode::kGlobal);
        llama::PagedGenerationOptions opt = options(nullptr);
        int steps = 0;
        opt.on_logits = [&](int64_t, int64_t, const at::Tensor&) {
          TORCH_CHECK(rank == 0 || ++steps < 3, "rank 1 stops here");
        };
        llama::generate_paged(shard, prompts(), opt);
      } catch (const c10::Error& e) {
        errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
      }
      seconds[static_cast<size_t>(rank)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  for (auto& t : ranks) t.join();
  EXPECT_NE(errors[1].find("rank 1 stops here"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("tensor-parallel model: rank 0 of 2: an all-reduce (sum) failed"), std::string::npos)
      << errors[0];
  EXPECT_LT(seconds[0], 30.0);
}

TEST(TensorParallel, AShardRefusesWhatItCannotRun) {
  const std::shared_ptr<const HeadExchange> one_rank = [] {
    struct OneRank : HeadExchange {
      at::Tensor gather_heads(const at::Tensor& local) const override { return local; }
      at::Tensor sum_over_ranks(const at::Tensor& partial) const override { return partial; }
      at::Tensor max_over_ranks(const at::Tensor& partial) const override { return partial; }
    };
    return std::make_shared<const OneRank>();
  }();
  testing::expect_error(
      [&] {
        model().shard({0, 3, one_rank, true});
      },
      {"LlamaModel::shard: the world size (3) must divide the KV heads (4) and the intermediate size"});
  testing::expect_error(
      [&] {
        model().shard({2, 2, one_rank, true});
      },
      {"LlamaModel::shard: rank must be in [0, world), got rank 2 of world 2"});
  testing::expect_error([&] { model().shard({0, 2, nullptr, true}); }, {"LlamaModel::shard: tp.exchange must be set"});
  // Rank 0 of 2 whose other rank's sums are its own: enough to reach the checks.
  const LlamaModel shard = model().shard({0, 2, one_rank, true});
  EXPECT_EQ(shard.config().num_kv_heads, 2);
  EXPECT_EQ(shard.config().num_heads, 4);
  EXPECT_EQ(shard.config().intermediate_size, 192);
  ASSERT_NE(shard.tensor_parallel(), nullptr);
  EXPECT_EQ(model().tensor_parallel(), nullptr);
  testing::expect_error(
      [&] {
        shard.shard({0, 2, one_rank, true});
      },
      {"LlamaModel::shard: the model is already a shard (rank 0 of 2)"});
  // A press whose scores need every head in a way it does not exchange (head_span whole_layer; no
  // registered press is one): refused at every entry point (the dense prefill, the KVzip passes').
  struct EveryHeadPress : KnormPress {
    std::string name() const override { return "EveryHeadPress"; }
    HeadSpan head_span() const override { return HeadSpan::kWholeLayer; }
  };
  const EveryHeadPress every_head;
  llama::GenerationOptions with_every_head;
  with_every_head.press = &every_head;
  testing::expect_error([&] { llama::generate_greedy(shard, prompts()[0], {}, with_every_head); },
                        {"LlamaModel::prefill: on a tensor-parallel shard, EveryHeadPress cannot be sharded across "
                         "ranks: its scores need every head of the layer"});
  testing::expect_error([&] { llama::generate_paged(shard, prompts(), options(&every_head)); },
                        {"on a tensor-parallel shard, EveryHeadPress cannot be sharded across ranks"});
  LoraAdapter for_the_shard;  // shaped for rank 0's own o_proj [128, 64]: the whole one is [128, 128]
  for_the_shard.add(0, "o_proj", {at::zeros({2, 64}), at::zeros({128, 2}), 1.0});
  testing::expect_error([&] { shard.check_adapter(for_the_shard, "test"); },
                        {"test: the LoRA adapter's layer 0 o_proj needs A [r, 128] and B [128, r] (the weight is "
                         "[128, 128]), got A [2, 64] and B [128, 2]"});
  // Ranks that disagree (here the budget mode) are refused on every rank at setup.
  const testing::TemporaryFolder dir("kvpress_tp_mismatch");
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto group = distributed::gloo_group(dir.file("store"), rank, 2, std::chrono::seconds(30));
        llama::tensor_parallel_shard(model(), group, rank == 0 ? BudgetMode::kGlobal : BudgetMode::kPerRank);
      } catch (const c10::Error& e) {
        errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_NE(errors[0].find("tensor_parallel_shard: rank 0 (2 layers, 8 heads, 4 KV heads, hidden 128, Float, "
                           "global budgets) differs from: rank 1: budget mode 0 (here 1)"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("differs from: rank 0: budget mode 1 (here 0)"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace kvpress
