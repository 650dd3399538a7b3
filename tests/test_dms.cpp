// DMSPress: threshold eviction behind a sliding window, at prefill and while decoding.
//
// DMS.*        unit tests (no fixtures): the prefill rule and the decoding window by hand, every
//              error, KVCache::evict on both layouts, the runner's loops (generation, pipeline,
//              paged refusal).
// DMSParity.*  against tests/reference/make_dms_fixtures.py (kvpress's DMSPress in the model's loop,
//              its evictions applied by its attention patch): kept tokens after the prefill and at the
//              end, the logits of every step, for the packed and the masked layouts.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/llama/llama.h"
#include "kvpress/presses/dms_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::DMSEviction;
using kvpress::DMSPress;
using kvpress::DMSWindow;
using kvpress::KnormPress;
using kvpress::llama::ForwardOptions;
using kvpress::llama::KVCache;
using kvpress::llama::LlamaModel;
using kvpress::llama::PrefillOptions;
using kvpress::testing::expect_error;
using kvpress::testing::tiny_model;
using kvpress::testing::tiny_tokenizer;

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous().flatten();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

// Keys whose norms are `norms` (one head, D = 2): KnormPress scores them -norm.
kvpress::LayerInputs keys_with_norms(const std::vector<float>& norms) {
  kvpress::LayerInputs in;
  const at::Tensor n = at::tensor(norms, at::kFloat);
  in.keys = at::stack({n, at::zeros_like(n)}, 1).view({1, 1, -1, 2});
  in.values = at::ones_like(in.keys);
  in.layer_idx = 0;
  return in;
}

TEST(DMS, PrefillJudgesOnlyTokensOlderThanTheWindow) {
  const DMSPress press(std::make_shared<KnormPress>(0.0), -2.5, 2);
  // Scores -1 -3 -2 -4 -5 -6: the first four are judged, -3 and -4 are below -2.5; the window keeps -5, -6.
  const at::Tensor keep = press.keep_mask(keys_with_norms({1, 3, 2, 4, 5, 6}));
  EXPECT_EQ(to_vector(keep), (std::vector<int64_t>{1, 0, 1, 0, 1, 1}));
  EXPECT_TRUE(press.head_ragged());
  EXPECT_EQ(press.compression_ratio(), 0.0);
  // A context within the window keeps everything.
  EXPECT_TRUE(
      DMSPress(std::make_shared<KnormPress>(0.0), -2.5, 8).keep_mask(keys_with_norms({9, 9})).all().item<bool>());
}

TEST(DMS, DecodingQueuesScoresAndJudgesWhatLeavesTheWindow) {
  const DMSPress press(std::make_shared<KnormPress>(0.0), -2.5, 2, true);
  DMSWindow window;
  press.prefill_window(keys_with_norms({1, 3, 2}), window);  // window: scores of positions 1, 2
  ASSERT_EQ(window.scores.size(), 1u);
  EXPECT_EQ(window.scores[0].size(2), 2);
  // Position 3 arrives (norm 9): position 1 (score -3) leaves and goes.
  kvpress::LayerInputs step = keys_with_norms({1, 3, 2, 9});
  step.hidden_states = at::zeros({1, 1, 4});
  DMSEviction e = press.decoding_step(step, 4, window);
  EXPECT_EQ(e.first, 1);
  EXPECT_EQ(to_vector(e.evict), (std::vector<int64_t>{1}));
  // Two more (norms 1, 1): positions 2 (-2, kept) and 3 (-9, evicted) leave.
  step = keys_with_norms({1, 3, 2, 9, 1, 1});
  step.hidden_states = at::zeros({1, 2, 4});
  e = press.decoding_step(step, 6, window);
  EXPECT_EQ(e.first, 2);
  EXPECT_EQ(to_vector(e.evict), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(window.scores[0].size(2), 2);
  // Window 0: every new token is judged at once.
  const DMSPress no_window(std::make_shared<KnormPress>(0.0), -2.5, 0, true);
  DMSWindow empty;
  step = keys_with_norms({3});
  step.hidden_states = at::zeros({1, 1, 4});
  e = no_window.decoding_step(step, 1, empty);
  EXPECT_EQ(e.first, 0);
  EXPECT_EQ(to_vector(e.evict), (std::vector<int64_t>{1}));
}

TEST(DMS, Errors) {
  const DMSPress unset(std::make_shared<KnormPress>(0.0));
  expect_error(
      [&] {
        unset.keep_mask(keys_with_norms({1, 2}));
      },
      {"DMSPress.keep_mask: threshold must be set (kvpress's default None cannot be compared"});
  expect_error([] { DMSPress(std::make_shared<KnormPress>(0.0), 1.0, -1); },
               {"DMSPress: sliding_window_size must be >= 0, got -1"});
  expect_error([] { DMSPress(nullptr, 1.0); }, {"DMSPress: press must be a ScorerPress, got nullptr"});
  const DMSPress press(std::make_shared<KnormPress>(0.0), -1.0, 1, true);
  expect_error([&] { press.compress(keys_with_norms({1, 2})); }, {"DMSPress keeps a different number of tokens"});
  DMSWindow window;
  kvpress::LayerInputs step = keys_with_norms({1});
  expect_error([&] { press.decoding_step(step, 1, window); }, {"DMSPress.decoding_step: hidden_states"});
  step.hidden_states = at::zeros({1, 3, 4});
  expect_error([&] { press.decoding_step(step, 3, window); },
               {"DMSPress.decoding_step: hidden_states must hold the forward's n new tokens (1 <= n <= 1"});
  // The registry: DMSPress takes no ratio; its threshold is optional there, refused at compression.
  const auto built = kvpress::make_press("DMSPress", 0.0, {{"threshold", "-3"}, {"decoding", "true"}});
  EXPECT_TRUE(dynamic_cast<const DMSPress&>(*built).decoding());
  EXPECT_TRUE(built->decoding_role().compresses);
  EXPECT_TRUE(built->decoding_role().evicts_per_head);
  EXPECT_NE(dynamic_cast<DMSWindow*>(built->new_sequence_state().get()), nullptr);
  const auto prefill_only = kvpress::make_press("DMSPress", 0.0, {{"threshold", "-3"}});
  EXPECT_FALSE(prefill_only->decoding_role().compresses);
  EXPECT_EQ(prefill_only->new_sequence_state(), nullptr);
  expect_error([] { kvpress::make_press("DMSPress", 0.5); }, {"DMSPress"});
}

TEST(DMS, CacheEvictsFromBothLayouts) {
  const LlamaModel& model = tiny_model();
  const auto ids = tiny_tokenizer().encode("Once upon a time, there was a little girl named Lily. She loved to play.");
  const at::Tensor batch = at::tensor(ids, at::kLong).unsqueeze(0);
  const int64_t n = batch.size(1), hkv = model.config().num_kv_heads;
  for (const auto layout : {PrefillOptions::RaggedLayout::kPacked, PrefillOptions::RaggedLayout::kMasked}) {
    KVCache cache = model.new_cache();
    const DMSPress press(std::make_shared<KnormPress>(0.0), -1e9, 4);  // evicts nothing at prefill
    PrefillOptions opt;
    opt.press = &press;
    opt.ragged_layout = layout;
    model.prefill(batch, cache, opt);
    at::Tensor evict = at::zeros({1, hkv, 3}, at::kBool);
    evict[0][1][0] = true;
    evict[0][0][2] = true;
    cache.evict(1, 5, evict);
    const at::Tensor mask =
        layout == PrefillOptions::RaggedLayout::kPacked ? cache.ragged(1).keep_mask() : cache.keep_mask(1);
    EXPECT_EQ(mask.logical_not().sum().item<int64_t>(), 2);
    EXPECT_FALSE(mask[0][1][5].item<bool>());
    EXPECT_FALSE(mask[0][0][7].item<bool>());
    if (layout == PrefillOptions::RaggedLayout::kPacked) {
      EXPECT_EQ(cache.ragged(1).total_tokens(), hkv * n - 2);
    }
    expect_error([&] { cache.evict(1, n - 1, evict); }, {"KVCache::evict: positions", "must be cached in layer 1"});
  }
}

TEST(DMS, RunnerLoops) {
  const LlamaModel& model = tiny_model();
  const auto& tok = tiny_tokenizer();
  const std::vector<int64_t> context = tok.encode(
      "Once upon a time, there was a little girl named Lily. She loved to "
      "play outside in the park with her red ball.");
  // generate_greedy with a DMSPress that evicts while decoding = the runner's loop by hand.
  const DMSPress press(std::make_shared<KnormPress>(0.0), -6.5, 4, true);
  kvpress::llama::GenerationOptions g;
  g.press = &press;
  g.max_new_tokens = 12;
  g.stop_at_eos = false;
  const auto generated = kvpress::llama::generate_greedy(model, context, {}, g);
  KVCache cache = model.new_cache();
  DMSWindow window;
  PrefillOptions opt;
  opt.press = &press;
  opt.press_state = &window;
  at::Tensor logits = model.prefill(at::tensor(context, at::kLong).unsqueeze(0), cache, opt).logits;
  ForwardOptions step;
  step.press = &press;
  step.press_state = &window;
  std::vector<int64_t> tokens;
  for (int i = 0; i < 12; ++i) {
    tokens.push_back(logits[0][logits.size(1) - 1].argmax().item<int64_t>());
    if (i + 1 < 12) logits = model.forward(at::tensor({tokens.back()}, at::kLong).unsqueeze(0), cache, step).logits;
  }
  EXPECT_EQ(generated.tokens, tokens);
  // Evictions happened while decoding: some head holds fewer tokens than it did after the prefill.
  EXPECT_LT(cache.ragged(0).total_tokens() + cache.ragged(1).total_tokens(),
            2 * model.config().num_kv_heads * static_cast<int64_t>(context.size() + 11));
  step.press_state = nullptr;
  expect_error([&] { model.forward(at::tensor({tokens.back()}, at::kLong).unsqueeze(0), cache, step); },
               {"LlamaModel: DMSPress needs a press_state"});
  // A single question through the pipeline; paged generation refuses decoding evictions.
  kvpress::llama::PipelineOptions p;
  p.press = &press;
  expect_error(
      [&] {
        kvpress::llama::answer_questions(model, tok, "Lily played.", {"Who?", "Where?"}, p);
      },
      {"DMSPress compresses while decoding and takes a single question"});
  EXPECT_EQ(kvpress::llama::answer_questions(model, tok, "Lily played.", {"Who?"}, p).size(), 1u);
  kvpress::llama::PagedGenerationOptions paged;
  paged.press = &press;
  expect_error([&] { kvpress::llama::generate_paged(model, {context}, paged); },
               {"DMSPress evicts per head while generating on the dense runner only"});
}

TEST(DMS, AFailedForwardLeavesTheCacheAndTheWindowAsTheyWere) {
  const LlamaModel& model = tiny_model();
  const DMSPress press(std::make_shared<KnormPress>(0.0), -6.5, 4, true);
  KVCache cache = model.new_cache();
  DMSWindow window;
  PrefillOptions opt;
  opt.press = &press;
  opt.press_state = &window;
  model.prefill(at::arange(3, 23, at::kLong).unsqueeze(0), cache, opt);
  ForwardOptions step;
  step.press = &press;
  step.press_state = &window;
  model.forward(at::tensor({5}, at::kLong).unsqueeze(0), cache, step);
  // Layer 1's queue claims more tokens than were ever seen: its decoding step raises after layer 0's
  // has queued and judged.
  DMSWindow broken = window;
  broken.scores[1] = at::zeros({1, model.config().num_kv_heads, 40});
  const DMSWindow snapshot = broken;
  const KVCache cache_before = cache;
  step.press_state = &broken;
  expect_error([&] { model.forward(at::tensor({6}, at::kLong).unsqueeze(0), cache, step); },
               {"DMSPress.decoding_step: tokens_seen (22) must be at least the 41 tokens the window holds"});
  for (size_t l = 0; l < snapshot.scores.size(); ++l)
    EXPECT_TRUE(broken.scores[l].is_same(snapshot.scores[l])) << "layer " << l;
  EXPECT_EQ(cache.position(), cache_before.position());
  for (int64_t l = 0; l < model.config().num_layers; ++l) {
    EXPECT_EQ(cache.ragged(l).total_tokens(), cache_before.ragged(l).total_tokens()) << "layer " << l;
  }
}

// ---- parity with kvpress 0.5.5 ----------------------------------------------------------------------

const kvpress::testing::FolderFixtures& dms_fixtures() {
  static const auto f = kvpress::testing::load_folder_fixtures("dms", "make_dms_fixtures.py");
  return f;
}

at::Tensor fixture(const std::string& file, const std::string& key) {
  const std::string path = dms_fixtures().dir + "/" + file;
  return kvpress::testing::fixture_tensor(kvpress::testing::load_fixture_file(path), key, path);
}

TEST(DMSParity, MatchesKvpressInTheModelLoop) {
  const auto& fx = dms_fixtures();
  ASSERT_TRUE(fx.error.empty()) << fx.error;
  ASSERT_EQ(fx.manifest.at("kvpress_version").get<std::string>(), "0.5.5");
  const LlamaModel& model = tiny_model();
  const std::string inputs = fx.manifest.at("inputs").get<std::string>();
  const at::Tensor context = fixture(inputs, "context_ids"), question = fixture(inputs, "question_ids");
  const int64_t n = context.size(1), num_layers = model.config().num_layers;
  ASSERT_GE(fx.manifest.at("runs").size(), 4u);
  for (const auto& jr : fx.manifest.at("runs")) {
    const std::string name = jr.at("name").get<std::string>(), file = jr.at("file").get<std::string>();
    auto params = jr.at("params").get<std::map<std::string, std::string>>();
    if (params.count("press.kvzap_model")) params["press.kvzap_model"] = fx.dir + "/" + params["press.kvzap_model"];
    const auto built = kvpress::make_press("DMSPress", 0.0, params);
    const auto& press = dynamic_cast<const DMSPress&>(*built);
    const at::Tensor ref_prefill = fixture(file, "prefill_mask"), ref_final = fixture(file, "final_mask");
    const at::Tensor tokens = fixture(file, "tokens"), ref_logits = fixture(file, "logits");
    for (const auto layout : {PrefillOptions::RaggedLayout::kPacked, PrefillOptions::RaggedLayout::kMasked}) {
      const bool packed = layout == PrefillOptions::RaggedLayout::kPacked;
      SCOPED_TRACE(name + (packed ? " packed" : " masked"));
      KVCache cache = model.new_cache();
      DMSWindow window;
      PrefillOptions opt;
      opt.press = &press;
      opt.press_state = &window;
      opt.ragged_layout = layout;
      const auto out = model.prefill(context, cache, opt);
      for (int64_t l = 0; l < num_layers; ++l)
        EXPECT_TRUE(at::equal(out.keep_masks[l][0], ref_prefill[l])) << "prefill, layer " << l;
      ForwardOptions step;
      step.last_logits_only = true;
      step.press = &press;
      step.press_state = &window;
      double max_diff = (model.forward(question, cache, step).logits[0][0] - ref_logits[0]).abs().max().item<double>();
      for (int64_t i = 0; i < tokens.size(0); ++i) {
        const at::Tensor logits = model.forward(tokens.narrow(0, i, 1).view({1, 1}), cache, step).logits[0][0];
        max_diff = std::max(max_diff, (logits - ref_logits[i + 1]).abs().max().item<double>());
      }
      EXPECT_LT(max_diff, 1e-4);
      int64_t evicted = 0;
      for (int64_t l = 0; l < num_layers; ++l) {
        const at::Tensor mask = packed ? cache.ragged(l).keep_mask()[0] : cache.keep_mask(l)[0];
        EXPECT_TRUE(at::equal(mask, ref_final[l])) << "final, layer " << l;
        evicted += mask.logical_not().sum().item<int64_t>();
      }
      EXPECT_EQ(evicted, jr.at("evicted").get<int64_t>());
      if (packed)
        std::cout << "[ dms ] " << std::left << std::setw(24) << name << " kept exact (" << evicted << " of "
                  << num_layers * ref_final.size(1) * (n + question.size(1) + tokens.size(0))
                  << " evicted), max |d logits| " << max_diff << "\n";
    }
  }
}

}  // namespace
