// KVComposePress: the session's budgets on hand-checkable inputs, errors, the Llama runner's second
// pass, and parity with kvpress 0.5.5.
//
// KVCompose.*        unit tests (no fixtures): statistics, scores and budgets computed by hand;
//                    every error message; the runner on TinyStories-656K (cache lengths = budgets,
//                    query-chunk invariance, memory figures, LlamaModel::prefill dispatch, the two
//                    unstructured layouts agree).
// KVComposeParity.*  against the fixtures of tests/reference/make_kvcompose_fixtures.py (one ctest
//                    entry): kvpress's scores, budgets, kept tokens per head (structured: the rows of
//                    its compressed cache; unstructured: the complement of masked_key_indices) and
//                    the next-token logits after compression (unstructured: kvpress's masked
//                    attention vs our head-ragged cache).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <iomanip>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/llama/llama.h"
#include "kvpress/presses/kvcompose_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::KVComposeOptions;
using kvpress::KVComposePress;
using kvpress::KVComposeSession;
using kvpress::llama::KVCache;
using kvpress::llama::KVComposeRunOptions;
using kvpress::llama::LlamaModel;
using kvpress::llama::PrefillOptions;
using kvpress::testing::expect_error;

// One query row per head: attentions [1, H, 1, N] whose max (and mean) is the row itself.
at::Tensor rows(const std::vector<std::vector<float>>& per_head) {
  std::vector<at::Tensor> t;
  for (const auto& r : per_head) t.push_back(at::tensor(r, at::kFloat));
  return at::stack(t).view({1, static_cast<int64_t>(per_head.size()), 1, -1});
}

// The worked example (Hq = Hkv = 2, N = 4, two layers), dyadic numbers so that every sum is exact:
//   layer 0: head 0 [.5, .375, .25, .125], head 1 [.125, .25, .375, .5]; head mean .3125 everywhere
//            -> S = [.8125, .6875, .5625, .4375] and its reverse
//   layer 1: head 0 [.75, .125, .0625, .0625], head 1 [.0625, .0625, .25, .625];
//            head mean [.40625, .09375, .15625, .34375]
//            -> S0 = [1.15625, .21875, .21875, .40625], S1 = [.46875, .15625, .40625, .96875]
//   sorted curves: layer 0 both [.8125, .6875, .5625, .4375]; layer 1 [1.15625, .40625, .21875, .21875]
//   and [.96875, .46875, .40625, .15625]; per-layer means C0 = [.8125, .6875, .5625, .4375],
//   C1 = [1.0625, .4375, .3125, .1875]; C0 := max(C0, C1) = [1.0625, .6875, .5625, .4375].
KVComposeSession worked_example(double ratio, KVComposeOptions o = {}) {
  KVComposeSession s = KVComposePress(ratio, o).start_session(2, 2, 2, 4);
  s.observe(0, rows({{.5f, .375f, .25f, .125f}, {.125f, .25f, .375f, .5f}}));
  s.observe(1, rows({{.75f, .125f, .0625f, .0625f}, {.0625f, .0625f, .25f, .625f}}));
  return s;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous().flatten();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

TEST(KVCompose, ScoresOfTheWorkedExample) {
  KVComposeSession s = worked_example(0.5);
  s.budgets();
  const at::Tensor expected = at::tensor({.8125f, .6875f, .5625f, .4375f, .4375f, .5625f, .6875f, .8125f, 1.15625f,
                                          .21875f, .21875f, .40625f, .46875f, .15625f, .40625f, .96875f})
                                  .view({2, 2, 4});
  EXPECT_TRUE(at::equal(s.scores(), expected)) << s.scores();
}

TEST(KVCompose, StructuredBudgetsByHand) {
  // Top n_kept(8, r) entries of [C0 | C1]: 1.0625 (both layers), .6875, .5625 (layer 0), then .4375 (both).
  EXPECT_EQ(worked_example(0.5).budgets().per_layer, (std::vector<int64_t>{3, 1}));   // top 4
  EXPECT_EQ(worked_example(0.25).budgets().per_layer, (std::vector<int64_t>{4, 2}));  // top 6
  EXPECT_EQ(worked_example(0.75).budgets().per_layer, (std::vector<int64_t>{1, 1}));  // top 2
  // Ratio 0 keeps everything.
  EXPECT_EQ(worked_example(0.0).budgets().per_layer, (std::vector<int64_t>{4, 4}));
  // keep_token_lower_bound 2: the first two ranks get +1e9 (all equal in float32), n_kept = 2 ties
  // go to layer 0, and the floor of 2 tokens per layer lifts layer 1.
  KVComposeOptions lb;
  lb.keep_token_lower_bound = 2;
  EXPECT_EQ(worked_example(0.75, lb).budgets().per_layer, (std::vector<int64_t>{2, 2}));
}

TEST(KVCompose, UnstructuredBudgetsByHand) {
  // All 16 sorted entries: 1.15625 (l1 h0), .96875 (l1 h1), .8125 x2, .6875 x2, .5625 x2 (layer 0), .46875 ...
  EXPECT_TRUE(at::equal(worked_example(0.5).budgets().per_head, at::tensor({3, 3, 1, 1}, at::kLong).view({2, 2})));
  EXPECT_TRUE(at::equal(worked_example(0.6).budgets().per_head, at::tensor({2, 2, 1, 1}, at::kLong).view({2, 2})));
  // n_kept(16, 0.5625) = 7: the two .5625 straddle the threshold; the lower (layer, head) wins.
  EXPECT_TRUE(at::equal(worked_example(0.5625).budgets().per_head, at::tensor({3, 2, 1, 1}, at::kLong).view({2, 2})));
}

TEST(KVCompose, EachHeadKeepsItsOwnBestTokens) {
  KVComposeSession s = worked_example(0.5);
  s.budgets();
  // Structured k = [3, 1]: layer 0 head 0 drops its worst (position 3), head 1 position 0.
  EXPECT_TRUE(at::equal(s.keep_mask(0), at::tensor({1, 1, 1, 0, 0, 1, 1, 1}, at::kLong).to(at::kBool).view({2, 4})));
  EXPECT_TRUE(at::equal(s.keep_mask(1), at::tensor({1, 0, 0, 0, 0, 0, 0, 1}, at::kLong).to(at::kBool).view({2, 4})));
  const at::Tensor keys = kvpress::testing::randn({1, 2, 4, 3}, 1), values = kvpress::testing::randn({1, 2, 4, 3}, 2);
  const kvpress::KV kv = s.compress(0, keys, values);
  EXPECT_EQ(to_vector(kv.kept_indices), (std::vector<int64_t>{0, 1, 2, 1, 2, 3}));
  EXPECT_TRUE(at::equal(kv.keys[0][1], keys[0][1].narrow(0, 1, 3)));
  EXPECT_TRUE(at::equal(kv.values[0][0], values[0][0].narrow(0, 0, 3)));
  // Within-head ties go to the lower position: layer 1 head 0 has .21875 at positions 1 and 2.
  // n_kept(16, 0.125) = 14: the 14th entry is one of those two (rows above it hold 13).
  KVComposeSession u = worked_example(0.125, KVComposeOptions{false});
  EXPECT_TRUE(at::equal(u.budgets().per_head, at::tensor({4, 4, 3, 3}, at::kLong).view({2, 2})));
  EXPECT_TRUE(at::equal(u.keep_mask(1), at::tensor({1, 1, 0, 1, 1, 0, 1, 1}, at::kLong).to(at::kBool).view({2, 4})));
  const kvpress::RaggedKV r = u.compress_ragged(1, keys, values);
  EXPECT_EQ(to_vector(r.at(0, 0).kept_indices), (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(to_vector(r.at(0, 1).kept_indices), (std::vector<int64_t>{0, 2, 3}));
}

TEST(KVCompose, AggregationsGroupsAndValueNorms) {
  // GQA: 4 query heads, 2 KV heads. Two observations of layer 0 (max vs mean over rows).
  KVComposeOptions o;
  o.add_mean_across_heads = false;
  const at::Tensor a = rows({{.5f, .25f}, {.25f, .5f}, {0.f, 1.f}, {.75f, .25f}});
  const at::Tensor b = rows({{.25f, .75f}, {.75f, .25f}, {1.f, 0.f}, {.25f, .25f}});
  auto run = [&](KVComposeOptions opt) {
    KVComposeSession s = KVComposePress(0.5, opt).start_session(1, 4, 2, 2);
    s.observe(0, a);
    s.observe(0, b);
    EXPECT_EQ(s.observed_rows(0), 2);
    s.budgets();
    return s.scores();
  };
  // max over rows: heads [.5,.75] [.75,.5] [1,1] [.75,.25]; group mean -> [.625,.625] [.875,.625]
  EXPECT_TRUE(at::equal(run(o), at::tensor({.625f, .625f, .875f, .625f}).view({1, 2, 2})));
  o.agg_group = "max";  // -> [.75,.75] [1, 1]
  EXPECT_TRUE(at::equal(run(o), at::tensor({.75f, .75f, 1.f, 1.f}).view({1, 2, 2})));
  o.agg_task = "mean";  // rows' mean: [.375,.5] [.5,.375] [.5,.5] [.5,.25]; group max -> [.5,.5] [.5,.5]
  EXPECT_TRUE(at::equal(run(o), at::tensor({.5f, .5f, .5f, .5f}).view({1, 2, 2})));
  // One [1, Hq, 2, N] observation equals the two single-row ones.
  {
    KVComposeSession s = KVComposePress(0.5, o).start_session(1, 4, 2, 2);
    s.observe(0, at::cat({a, b}, 2));
    s.budgets();
    EXPECT_TRUE(at::equal(s.scores(), at::tensor({.5f, .5f, .5f, .5f}).view({1, 2, 2})));
  }
  // Pre-aggregated statistics (sums for "mean") give the same.
  {
    KVComposeSession s = KVComposePress(0.5, o).start_session(1, 4, 2, 2);
    s.observe_statistics(0, (a + b).view({4, 2}), 2);
    s.budgets();
    EXPECT_TRUE(at::equal(s.scores(), at::tensor({.5f, .5f, .5f, .5f}).view({1, 2, 2})));
  }
  // add_v_norm multiplies by ||v|| of batch row 0 (before the mean across heads).
  o.add_v_norm = true;
  KVComposeSession s = KVComposePress(0.5, o).start_session(1, 4, 2, 2);
  s.observe(0, at::cat({a, b}, 2));
  // ||v||: head 0 [5, 1], head 1 [2, 0.5]; batch row 1 (ignored) would give other norms.
  const at::Tensor v =
      at::tensor({3.f, 4.f, 0.f, 1.f, 2.f, 0.f, 0.f, .5f, 9.f, 9.f, 9.f, 9.f, 9.f, 9.f, 9.f, 9.f}).view({2, 2, 2, 2});
  s.observe_values(0, v);
  s.budgets();
  EXPECT_TRUE(at::equal(s.scores(), at::tensor({2.5f, .5f, 1.f, .25f}).view({1, 2, 2})));
}

TEST(KVCompose, ColumnsBeyondTheContextAreIgnored) {
  KVComposeSession s = KVComposePress(0.5).start_session(1, 2, 2, 2);
  // Attentions over [context (2) | prompt keys (3)]; the prompt's columns are large and must not count.
  s.observe(0, at::tensor({.25f, .5f, 9.f, 9.f, 9.f, .5f, .25f, 9.f, 9.f, 9.f}).view({1, 2, 1, 5}));
  s.budgets();
  // add_mean_across_heads: [.25,.5] + [.375,.375]
  EXPECT_TRUE(at::equal(s.scores(), at::tensor({.625f, .875f, .875f, .625f}).view({1, 2, 2})));
}

TEST(KVCompose, Errors) {
  expect_error([] { KVComposePress(1.0); }, {"KVComposePress", "compression_ratio must be in [0, 1), got 1"});
  expect_error([] { KVComposePress(-0.1); }, {"compression_ratio must be in [0, 1)"});
  KVComposeOptions bad;
  bad.agg_task = "median";
  expect_error([&] { KVComposePress(0.5, bad); },
               {"KVComposePress: agg_task must be \"max\" or \"mean\", got \"median\""});
  bad = {};
  bad.agg_head = "sum";
  expect_error([&] { KVComposePress(0.5, bad); }, {"agg_head must be \"max\" or \"mean\", got \"sum\""});
  bad = {};
  bad.keep_token_lower_bound = -1;
  expect_error([&] { KVComposePress(0.5, bad); }, {"keep_token_lower_bound must be >= 0, got -1"});

  // The layer-level press contract refuses: it needs the engine's second pass.
  const KVComposePress press(0.5);
  kvpress::LayerInputs in;
  in.keys = kvpress::testing::randn({1, 2, 8, 4}, 3);
  in.values = in.keys.clone();
  expect_error([&] { press.compress(in); }, {"KVComposePress.compress", "second pass", "kvcompose_prefill"});
  expect_error([&] { KVComposePress(0.5, KVComposeOptions{false}).compress_ragged(in); }, {"second pass"});

  expect_error([&] { press.start_session(2, 6, 4, 8); },
               {"num_heads must be a positive multiple of num_kv_heads (4), got 6"});
  expect_error([&] { press.start_session(2, 4, 2, 0); }, {"context_len must be > 0, got 0"});
  expect_error([&] { press.start_session(0, 4, 2, 8); }, {"num_layers must be > 0, got 0"});

  KVComposeSession s = press.start_session(2, 4, 2, 8);
  const at::Tensor ok = at::rand({1, 4, 3, 8});
  expect_error([&] { s.observe(2, ok); }, {"KVComposeSession.observe: layer must be in [0, 2), got 2"});
  expect_error(
      [&] {
        s.observe(0, at::rand({1, 3, 3, 8}));
      },
      {"attentions must be [batch, 4, q_len, seq_len >= 8] (non-empty), got [1, 3, 3, 8]"});
  expect_error([&] { s.observe(0, at::rand({1, 4, 3, 7})); }, {"seq_len >= 8", "got [1, 4, 3, 7]"});
  expect_error([&] { s.observe(0, at::rand({4, 3, 8})); }, {"attentions must be [batch, num_heads, q_len, seq_len]"});
  expect_error([&] { s.observe_statistics(0, at::rand({4, 7}), 1); }, {"statistics must be [4, 8], got [4, 7]"});
  expect_error([&] { s.observe_statistics(0, at::rand({4, 8}), 0); }, {"rows must be > 0, got 0"});
  const at::Tensor keys = at::rand({1, 2, 8, 4});
  expect_error([&] { s.compress(0, keys, keys); }, {"KVComposeSession.compress: call budgets() first"});
  expect_error([&] { s.keep_mask(0); }, {"call budgets() first"});
  s.observe(0, ok);
  expect_error([&] { s.budgets(); }, {"KVComposeSession.budgets: layer 1 has no observed attention"});
  s.observe(1, ok);
  s.budgets();
  expect_error([&] { s.observe(0, ok); }, {"the budgets were already computed"});
  expect_error(
      [&] {
        s.compress(0, at::rand({1, 2, 7, 4}), at::rand({1, 2, 7, 4}));
      },
      {"keys must be [batch, 2, 8, head_dim] (the context's cache), got [1, 2, 7, 4]"});
  expect_error([&] { s.compress(0, keys, at::rand({1, 2, 8, 5})); }, {"values must have the shape of keys"});

  KVComposeSession u = KVComposePress(0.5, KVComposeOptions{false}).start_session(2, 4, 2, 8);
  u.observe(0, ok);
  u.observe(1, ok);
  u.budgets();
  expect_error([&] { u.compress(0, keys, keys); }, {"unstructured variant", "use compress_ragged()"});

  KVComposeOptions vn;
  vn.add_v_norm = true;
  KVComposeSession v = KVComposePress(0.5, vn).start_session(1, 4, 2, 8);
  v.observe(0, ok);
  expect_error([&] { v.budgets(); }, {"add_v_norm needs layer 0's values (observe_values)"});
  expect_error(
      [&] {
        v.observe_values(0, at::rand({1, 3, 8, 4}));
      },
      {"values must be [batch, 2, seq_len >= 8, head_dim]"});

  KVComposeSession nan = press.start_session(1, 4, 2, 8);
  nan.observe(0, at::full({1, 4, 1, 8}, NAN));
  expect_error([&] { nan.budgets(); }, {"NaN or Inf"});
}

TEST(KVCompose, Registry) {
  bool listed = false;
  for (const auto& info : kvpress::list_presses()) {
    if (info.name != "KVComposePress") continue;
    listed = true;
    EXPECT_EQ(info.kind, kvpress::PressKind::kSecondPass);
  }
  EXPECT_TRUE(listed);
  const auto p = kvpress::make_press("KVComposePress", 0.4,
                                     {{"structured", "false"},
                                      {"agg_task", "mean"},
                                      {"agg_group", "max"},
                                      {"agg_head", "max"},
                                      {"add_v_norm", "true"},
                                      {"add_mean_across_heads", "false"},
                                      {"keep_token_lower_bound", "3"}});
  const auto& k = dynamic_cast<const KVComposePress&>(*p);
  EXPECT_DOUBLE_EQ(k.compression_ratio(), 0.4);
  EXPECT_TRUE(k.head_ragged());
  EXPECT_EQ(k.options().agg_task, "mean");
  EXPECT_EQ(k.options().agg_group, "max");
  EXPECT_EQ(k.options().agg_head, "max");
  EXPECT_TRUE(k.options().add_v_norm);
  EXPECT_FALSE(k.options().add_mean_across_heads);
  EXPECT_EQ(k.options().keep_token_lower_bound, 3);
  const auto d = kvpress::make_press("KVComposePress", 0.5);
  EXPECT_FALSE(d->head_ragged());
  expect_error([] { kvpress::make_press("KVComposePress", 0.5, {{"agg_task", "min"}}); }, {"agg_task must be"});
  expect_error([] { kvpress::make_press("KVComposePress", 0.5, {{"window", "3"}}); }, {"unknown parameter 'window'"});
}

// ---- the Llama runner ----------------------------------------------------------------------------

using kvpress::testing::tiny_model;

at::Tensor story_ids(int64_t n) {
  // A deterministic token sequence from the vocabulary (the runner does not care what it means).
  at::manual_seed(7);
  at::Tensor ids = at::randint(3, 2048, {1, n}, at::kLong);
  ids[0][0] = 1;  // BOS
  return ids;
}

TEST(KVCompose, RunnerCompressesEveryLayerToItsBudget) {
  const LlamaModel& model = tiny_model();
  const at::Tensor ids = story_ids(96);
  KVCache cache = model.new_cache();
  const KVComposePress press(0.5);
  KVComposeRunOptions run;
  run.query_chunk = 32;
  const auto r = kvpress::llama::kvcompose_prefill(model, ids, cache, press, run);
  ASSERT_EQ(r.budgets.per_layer.size(), 2u);
  EXPECT_GE(r.budgets.per_layer[0], r.budgets.per_layer[1]);  // layer 0 gets the largest curve
  int64_t total = 0;
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_EQ(cache.length(l), r.budgets.per_layer[l]);
    EXPECT_EQ(r.prefill.kept_indices[l].sizes(), (at::IntArrayRef{1, 4, r.budgets.per_layer[l]}));
    total += r.budgets.per_layer[l];
  }
  EXPECT_EQ(total, 96);  // n_kept(2 * 96, 0.5), no floor needed
  EXPECT_EQ(cache.position(), 96);
  EXPECT_EQ(r.prefill.logits.sizes(), (at::IntArrayRef{1, 96, 2048}));
  // Memory: the pass held less than kvpress's lower bound for the same pass.
  EXPECT_GT(r.memory.peak_bytes, 0);
  EXPECT_EQ(r.memory.peak_bytes,
            r.memory.hidden_bytes + r.memory.prompt_kv_bytes + r.memory.attention_bytes + r.memory.statistics_bytes);
  EXPECT_EQ(r.memory.statistics_bytes, 2 * 8 * 96 * 4);  // [L, Hq, N] float32
  EXPECT_LT(r.memory.peak_bytes, r.memory.kvpress_bytes);
  std::cout << "[ kvcompose ] second pass, N = P = 96, chunk 32: peak " << r.memory.peak_bytes << " B (hidden "
            << r.memory.hidden_bytes << ", prompt K/V " << r.memory.prompt_kv_bytes << ", attention "
            << r.memory.attention_bytes << ", statistics " << r.memory.statistics_bytes
            << "); kvpress >= " << r.memory.kvpress_bytes << " B\n";
  // Decoding continues at the original positions.
  const auto next = model.forward(ids.narrow(1, 95, 1), cache);
  EXPECT_EQ(cache.length(0), r.budgets.per_layer[0] + 1);
  EXPECT_TRUE(at::isfinite(next.logits).all().item<bool>());
}

TEST(KVCompose, QueryChunkingDoesNotChangeTheResult) {
  const LlamaModel& model = tiny_model();
  const at::Tensor ids = story_ids(80);
  const KVComposePress press(0.6, KVComposeOptions{false});
  std::vector<kvpress::llama::KVComposeResult> results;
  for (int64_t chunk : {80, 17, 5}) {
    KVCache cache = model.new_cache();
    KVComposeRunOptions run;
    run.query_chunk = chunk;
    results.push_back(kvpress::llama::kvcompose_prefill(model, ids, cache, press, run));
  }
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_TRUE(at::equal(results[i].budgets.per_head, results[0].budgets.per_head));
    for (size_t l = 0; l < 2; ++l)
      EXPECT_TRUE(at::equal(results[i].prefill.keep_masks[l], results[0].prefill.keep_masks[l])) << l;
    // Smaller chunks hold smaller attention blocks.
    EXPECT_LT(results[i].memory.attention_bytes, results[i - 1].memory.attention_bytes);
  }
}

TEST(KVCompose, PrefillDispatchesAndBothUnstructuredLayoutsAgree) {
  const LlamaModel& model = tiny_model();
  const at::Tensor ids = story_ids(64);
  // LlamaModel::prefill with a KVComposePress runs the second pass (as eval and generation do).
  {
    const auto press = kvpress::make_press("KVComposePress", 0.5);
    KVCache a = model.new_cache(), b = model.new_cache();
    PrefillOptions opt;
    opt.press = press.get();
    int calls = 0;
    opt.on_compress = [&](const kvpress::LayerInputs& in, const kvpress::KV& kv) {
      EXPECT_EQ(in.layer_idx, calls++);
      EXPECT_EQ(in.keys.size(2), 64);
      EXPECT_EQ(kv.keys.size(2), kv.kept_indices.size(2));
    };
    const auto out = model.prefill(ids, a, opt);
    EXPECT_EQ(calls, 2);
    const auto rb = kvpress::llama::kvcompose_prefill(model, ids, b, dynamic_cast<const KVComposePress&>(*press));
    ASSERT_EQ(out.kept_indices.size(), 2u);
    for (int64_t l = 0; l < 2; ++l) {
      EXPECT_TRUE(at::equal(a.keys(l), b.keys(l)));
      EXPECT_TRUE(at::equal(out.kept_indices[l], rb.prefill.kept_indices[l]));
    }
    EXPECT_TRUE(at::equal(out.logits, rb.prefill.logits));
  }
  // Unstructured: packed head-ragged layers vs the dense layer with a keep mask (kvpress's way).
  const KVComposePress press(0.7, KVComposeOptions{false});
  KVCache packed = model.new_cache(), masked = model.new_cache();
  PrefillOptions opt;
  opt.ragged_layout = PrefillOptions::RaggedLayout::kPacked;
  const auto rp = kvpress::llama::kvcompose_prefill(model, ids, packed, press, {}, opt);
  opt.ragged_layout = PrefillOptions::RaggedLayout::kMasked;
  const auto rm = kvpress::llama::kvcompose_prefill(model, ids, masked, press, {}, opt);
  for (int64_t l = 0; l < 2; ++l) {
    ASSERT_TRUE(packed.is_ragged(l));
    EXPECT_FALSE(masked.is_ragged(l));
    EXPECT_TRUE(at::equal(packed.ragged(l).lengths(), rp.budgets.per_head[l].view({1, 4})));
    EXPECT_TRUE(at::equal(rp.prefill.keep_masks[l], rm.prefill.keep_masks[l]));
  }
  const at::Tensor next = story_ids(66).narrow(1, 64, 2);
  const auto lp = model.forward(next, packed).logits, lm = model.forward(next, masked).logits;
  EXPECT_LT((lp - lm).abs().max().item<double>(), 1e-4);
  EXPECT_LT(packed.bytes(), masked.bytes());
}

TEST(KVCompose, RunnerErrors) {
  const LlamaModel& model = tiny_model();
  const KVComposePress press(0.5);
  KVCache cache = model.new_cache();
  KVComposeRunOptions run;
  run.query_chunk = 0;
  expect_error([&] { kvpress::llama::kvcompose_prefill(model, story_ids(8), cache, press, run); },
               {"kvcompose_prefill: query_chunk must be > 0, got 0"});
  run.query_chunk = 8;
  run.task_prompts = {at::ones({2, 4}, at::kLong)};
  expect_error([&] { kvpress::llama::kvcompose_prefill(model, story_ids(8), cache, press, run); },
               {"task_prompts[0] must be a non-empty int64 [1, P] tensor, got [2, 4]"});
  expect_error(
      [&] {
        kvpress::llama::kvcompose_prefill(model, at::ones({1, 4}), cache, press);
      },
      {"context_ids must be a non-empty int64 [batch, n] tensor"});
}

// ---- parity with kvpress 0.5.5 ----------------------------------------------------------------------

using json = nlohmann::json;

const kvpress::testing::FolderFixtures& kvcompose_fixtures() {
  static const auto f = kvpress::testing::load_folder_fixtures("kvcompose", "make_kvcompose_fixtures.py");
  return f;
}

at::Tensor fixture(const std::string& file, const std::string& key) {
  const std::string path = kvcompose_fixtures().dir + "/" + file;
  return kvpress::testing::fixture_tensor(kvpress::testing::load_fixture_file(path), key, path);
}

std::map<std::string, std::string>& parity_summary() {
  static std::map<std::string, std::string> s;
  return s;
}
class KVComposeSummary : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& [name, line] : parity_summary())
      std::cout << "[ kvcompose ] " << std::left << std::setw(28) << name << line << "\n";
  }
};
[[maybe_unused]] ::testing::Environment* const kSummary = ::testing::AddGlobalTestEnvironment(new KVComposeSummary);

TEST(KVComposeParity, MatchesKvpress) {
  const auto& fx = kvcompose_fixtures();
  ASSERT_TRUE(fx.error.empty()) << fx.error;
  ASSERT_EQ(fx.manifest.at("kvpress_version").get<std::string>(), "0.5.5");
  const LlamaModel& model = tiny_model();
  const std::string inputs = fx.manifest.at("inputs").get<std::string>();
  const at::Tensor context = fixture(inputs, "context_ids"), prompt = fixture(inputs, "prompt_ids");
  const int64_t n = context.size(1), num_layers = model.config().num_layers;
  ASSERT_EQ(n, fx.manifest.at("context_len").get<int64_t>());
  ASSERT_GE(fx.manifest.at("runs").size(), 9u);

  for (const json& jr : fx.manifest.at("runs")) {
    const std::string name = jr.at("name").get<std::string>(), file = jr.at("file").get<std::string>();
    SCOPED_TRACE(name);
    const auto press = kvpress::make_press("KVComposePress", jr.at("compression_ratio").get<double>(),
                                           jr.at("params").get<std::map<std::string, std::string>>());
    const auto& kvcompose = dynamic_cast<const KVComposePress&>(*press);
    const bool structured = kvcompose.options().structured;
    KVComposeRunOptions run;
    if (jr.at("custom_prompt").get<bool>()) run.task_prompts = {prompt};
    KVCache cache = model.new_cache();
    PrefillOptions opt;
    opt.ragged_layout = PrefillOptions::RaggedLayout::kPacked;
    const auto r = kvpress::llama::kvcompose_prefill(model, context, cache, kvcompose, run, opt);

    // 1. Budgets: kvpress's exactly.
    const at::Tensor ref_per_layer = fixture(file, "per_layer"), ref_per_head = fixture(file, "per_head");
    EXPECT_EQ(r.budgets.per_layer,
              std::vector<int64_t>(ref_per_layer.data_ptr<int64_t>(), ref_per_layer.data_ptr<int64_t>() + num_layers));
    EXPECT_TRUE(at::equal(r.budgets.per_head, ref_per_head)) << r.budgets.per_head << "\nkvpress:\n" << ref_per_head;

    // 2. Scores within float32 noise (our second pass chunks the queries and splits the attention
    // matmuls, kvpress runs one eager forward).
    const at::Tensor ref_scores = fixture(file, "scores"), ref_mask = fixture(file, "keep_mask");
    const double scores_rel = ((r.scores - ref_scores).abs().max() / ref_scores.abs().max()).item<double>();
    EXPECT_LT(scores_rel, 1e-5);
    // 3. Kept tokens per head; where they differ, only at near-ties of kvpress's scores.
    int64_t n_diff = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor ours = structured ? at::zeros({1, 4, n}, at::kBool).scatter_(2, r.prefill.kept_indices[l], true)
                                         : r.prefill.keep_masks[l];
      const at::Tensor diff = ours[0].logical_xor(ref_mask[l]);
      n_diff += diff.sum().item<int64_t>();
      if (!diff.any().item<bool>()) continue;
      // A position kept by one side only must score within 1e-5 (relative to the layer's largest
      // score) of the head's selection threshold in kvpress's scores.
      const at::Tensor s = ref_scores[l];
      const at::Tensor threshold =
          at::where(ref_mask[l], s, at::full_like(s, INFINITY)).amin(1, true);  // lowest kept score per head
      const at::Tensor far = diff.logical_and((s - threshold).abs() > 1e-5 * s.abs().max());
      EXPECT_FALSE(far.any().item<bool>()) << "layer " << l << ": " << far.sum().item<int64_t>()
                                           << " positions kept by one side only, far from the threshold";
    }
    // Structured: the cache holds k_l tokens per head; unstructured: each head its own count.
    for (int64_t l = 0; l < num_layers; ++l) {
      if (structured) {
        EXPECT_EQ(cache.length(l), ref_per_layer[l].item<int64_t>());
      } else {
        EXPECT_TRUE(at::equal(cache.ragged(l).lengths(), ref_per_head[l].view({1, -1})));
      }
    }

    // 4. Logits of the next tokens (one per forward, at positions N, N + 1, ...) over the compressed
    // cache: kvpress's cache (structured) or masked attention over the context (unstructured).
    const at::Tensor tokens = fixture(file, "decode_tokens"), ref_logits = fixture(file, "decode_logits");
    double max_diff = 0;
    for (int64_t i = 0; i < tokens.size(0); ++i) {
      const auto out = model.forward(tokens.narrow(0, i, 1).view({1, 1}), cache);
      max_diff = std::max(max_diff, (out.logits[0][0] - ref_logits[i]).abs().max().item<double>());
    }
    EXPECT_LT(max_diff, 1e-4);
    std::ostringstream line;
    line << "budgets " << (structured ? "k_l " : "k_lg ") << "exact, kept "
         << (n_diff == 0 ? std::string("exact") : "modulo " + std::to_string(n_diff) + " near-ties")
         << ", max rel |d score| " << std::setprecision(3) << scores_rel << ", max |d logits| " << max_diff;
    parity_summary()[name] = line.str();
  }
}

}  // namespace
