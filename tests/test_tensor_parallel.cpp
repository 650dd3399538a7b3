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

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distributed_layer.h"
#include "kvpress/llama/llama.h"
#include "kvpress/llama/tensor_parallel.h"
#include "kvpress/presses/decoding_press.h"
#include "kvpress/registry.h"
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

// Every rank of `world` (threads) generates over its shard: [rank].
std::vector<RankGeneration> tensor_parallel_runs(int world, BudgetMode budgets, const BasePress* press) {
  const testing::TemporaryFolder dir("kvpress_tp");
  std::vector<RankGeneration> runs(static_cast<size_t>(world));
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        auto group = distributed::gloo_group(dir.file("store"), rank, world, std::chrono::seconds(60));
        const LlamaModel shard = llama::tensor_parallel_shard(model(), group, budgets);
        runs[static_cast<size_t>(rank)] = generate(shard, press);
      } catch (const c10::Error& e) {
        runs[static_cast<size_t>(rank)].error = e.what_without_backtrace();
      }
    });
  for (auto& t : ranks) t.join();
  return runs;
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

// KVComposePress's second pass on shards (the dense runner): each rank observes its heads, and the
// budgets are set over every rank's (the mean over heads, the composite curves, the per-head
// ranking), so every rank keeps what one process keeps of its heads: each head's kept count equals
// one process's for that head (structured: k_l; unstructured: k_{l,g}), and the tokens are the same.
TEST(TensorParallel, KVComposeBudgetsOverEveryRanksHeads) {
  for (const char* structured : {"true", "false"}) {
    SCOPED_TRACE(std::string("structured ") + structured);
    const std::shared_ptr<const BasePress> press = make_press("KVComposePress", 0.5, {{"structured", structured}});
    llama::GenerationOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = 8;
    opt.stop_at_eos = false;
    const llama::Generation one = llama::generate_greedy(model(), prompts()[0], {}, opt);
    const std::vector<std::vector<int64_t>> one_kept = kept_per_head(model(), *press);
    for (int world : {2, 4}) {
      std::vector<std::vector<std::vector<int64_t>>> kept(static_cast<size_t>(world));
      const testing::TemporaryFolder dir("kvpress_tp_kvcompose");
      std::vector<llama::Generation> runs(static_cast<size_t>(world));
      std::vector<std::string> errors(static_cast<size_t>(world));
      std::vector<std::thread> ranks;
      for (int rank = 0; rank < world; ++rank)
        ranks.emplace_back([&, rank] {
          try {
            auto group = distributed::gloo_group(dir.file("store"), rank, world, std::chrono::seconds(60));
            const LlamaModel shard = llama::tensor_parallel_shard(model(), group, BudgetMode::kGlobal);
            runs[static_cast<size_t>(rank)] = llama::generate_greedy(shard, prompts()[0], {}, opt);
            kept[static_cast<size_t>(rank)] = kept_per_head(shard, *press);
          } catch (const c10::Error& e) {
            errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
          }
        });
      for (auto& t : ranks) t.join();
      for (int rank = 0; rank < world; ++rank) {
        ASSERT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank << " of " << world;
        EXPECT_EQ(runs[static_cast<size_t>(rank)].tokens, one.tokens) << "rank " << rank << " of " << world;
        const int64_t heads = 4 / world;
        for (size_t l = 0; l < one_kept.size(); ++l) {
          const std::vector<int64_t> mine(one_kept[l].begin() + rank * heads, one_kept[l].begin() + (rank + 1) * heads);
          EXPECT_EQ(kept[static_cast<size_t>(rank)][l], mine) << "rank " << rank << " of " << world << ", layer " << l;
        }
      }
      if (std::string(structured) == "false")  // heads of a layer keep different counts
        EXPECT_NE(one_kept[0].front(), one_kept[0].back());
    }
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
  const auto kvzip = make_press("KVzipPress", 0.5);
  testing::expect_error([&] { llama::generate_paged(shard, prompts(), options(kvzip.get())); },
                        {"on a tensor-parallel shard, KVzipPress cannot be sharded across ranks yet"});
  // CAMPress keeps the top of scores averaged over every head (head_span whole_layer), unexchanged.
  const auto cam = make_press("CAMPress", 0.0, {{"target_size", "48"}, {"compression_interval", "3"}});
  llama::GenerationOptions with_cam;
  with_cam.press = cam.get();
  testing::expect_error([&] { llama::generate_greedy(shard, prompts()[0], {}, with_cam); },
                        {"on a tensor-parallel shard, CAMPress cannot be sharded across ranks: its scores need every "
                         "head of the layer"});
  const auto dms = make_press("DMSPress", 0.0, {{"threshold", "-3"}, {"decoding", "true"}});
  llama::GenerationOptions dense;
  dense.press = dms.get();
  testing::expect_error([&] { llama::generate_greedy(shard, prompts()[0], {}, dense); },
                        {"on a tensor-parallel shard, DMSPress cannot run yet: it evicts per head while decoding"});
  LoraAdapter adapter;
  adapter.add(0, "o_proj", {at::zeros({2, 128}), at::zeros({128, 2}), 1.0});
  testing::expect_error([&] { shard.check_adapter(adapter, "test"); },
                        {"test: LoRA adapters are not applied on a tensor-parallel shard"});
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
