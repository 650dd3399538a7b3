// CAMPress: merge-then-prune while decoding.
//
// CAM.*        unit tests: a merge computed by hand (probability 1: no draw decides), errors.
// CAMParity.*  against tests/reference/make_cam_fixtures.py (kvpress's CAMPress in the model's loop,
//              the same seed for its Bernoulli draws): logits of every step, final keys and values.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fixtures.h"
#include "kvpress/llama/llama.h"
#include "kvpress/presses/cam_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::CAMPress;
using kvpress::llama::ForwardOptions;
using kvpress::llama::KVCache;
using kvpress::llama::LlamaModel;
using kvpress::testing::expect_error;
using kvpress::testing::tiny_model;

kvpress::ScorerFactory knorm() {
  return [](double r) { return std::make_shared<kvpress::KnormPress>(r); };
}

TEST(CAM, MergesTheBestEvictedValueIntoItsKeptSuccessors) {
  // One head, five tokens, D = 2; key norms 1 5 2 4 3 -> Knorm keeps the smallest norms. Target 3:
  // kept positions 0, 2, 4; evicted 1 (score -5) and 3 (-4). One merge candidate: the best evicted,
  // position 3. Its window (merge_budget 2): the kept tokens after it, only position 4.
  kvpress::LayerInputs in;
  in.keys = at::tensor({1.f, 0.f, 5.f, 0.f, 2.f, 0.f, 4.f, 0.f, 3.f, 0.f}).view({1, 1, 5, 2});
  in.values = at::arange(10, at::kFloat).view({1, 1, 5, 2});
  // Attention: position 3 gets more than its window's mean -> probability 1, no draw decides.
  const at::Tensor attention = at::tensor({.1f, .1f, .1f, .5f, .2f}).view({1, 1, 5});
  const CAMPress press(knorm(), 1, 3, 0, 2);
  const kvpress::KV kv = press.merge_and_prune(in, attention, 1);
  EXPECT_TRUE(at::equal(kv.kept_indices, at::tensor({0L, 2L, 4L}).view({1, 1, 3})));
  // v_4 += v_3 / |window| = [8, 9] + [6, 7].
  EXPECT_TRUE(at::allclose(kv.values[0][0], at::tensor({0.f, 1.f, 4.f, 5.f, 14.f, 16.f}).view({3, 2})));
  EXPECT_TRUE(at::equal(kv.keys[0][0], in.keys[0][0].index_select(0, at::tensor({0L, 2L, 4L}))));
  // With attention below the window's mean times 0 (zero): probability 0, nothing merged.
  const kvpress::KV unmerged = press.merge_and_prune(in, at::tensor({.1f, .1f, .1f, 0.f, .2f}).view({1, 1, 5}), 1);
  EXPECT_TRUE(at::equal(unmerged.values[0][0][2], in.values[0][0][4]));
  expect_error(
      [&] {
        press.merge_and_prune(in, at::ones({1, 1, 4}), 1);
      },
      {"CAMPress.merge_and_prune: attention_sums must be [1, 1, 5], got [1, 1, 4]"});
  expect_error([] { CAMPress(knorm(), 1, 3, 0, 0); }, {"CAMPress: merge_budget must be > 0, got 0"});
  EXPECT_TRUE(press.reads_cache_every_step());
}

// ---- parity with kvpress 0.5.5 ----------------------------------------------------------------------

const kvpress::testing::FolderFixtures& cam_fixtures() {
  static const auto f = kvpress::testing::load_folder_fixtures("cam", "make_cam_fixtures.py");
  return f;
}

at::Tensor fixture(const std::string& file, const std::string& key) {
  const std::string path = cam_fixtures().dir + "/" + file;
  return kvpress::testing::fixture_tensor(kvpress::testing::load_fixture_file(path), key, path);
}

TEST(CAM, AFailedForwardLeavesTheCacheAndTheStateAsTheyWere) {
  const LlamaModel& model = tiny_model();
  const auto built = kvpress::make_press("CAMPress", 0.0, {{"target_size", "16"}, {"compression_interval", "3"}});
  KVCache cache = model.new_cache();
  model.prefill(at::arange(3, 23, at::kLong).unsqueeze(0), cache);
  kvpress::DecodingState state;
  ForwardOptions step;
  step.press = built.get();
  step.press_state = &state;
  model.forward(at::tensor({5}, at::kLong).unsqueeze(0), cache, step);
  // Layer 1's running attention claims more tokens than its cache holds: its step raises after
  // layer 0's has summed and counted.
  state.attention_sums[1] = at::zeros({1, model.config().num_kv_heads, 50});
  const kvpress::DecodingState snapshot = state;
  const KVCache cache_before = cache;
  expect_error([&] { model.forward(at::tensor({6}, at::kLong).unsqueeze(0), cache, step); },
               {"the cache shrank behind the press's back (50 summed, 22 cached)"});
  EXPECT_EQ(state.steps, snapshot.steps);
  for (size_t l = 0; l < snapshot.attention_sums.size(); ++l) {
    EXPECT_TRUE(state.attention_sums[l].is_same(snapshot.attention_sums[l])) << "layer " << l;
    EXPECT_EQ(state.hidden_states[l].size(), snapshot.hidden_states[l].size()) << "layer " << l;
  }
  EXPECT_EQ(cache.position(), cache_before.position());
  EXPECT_EQ(cache.length(0), cache_before.length(0));
}

TEST(CAMParity, MatchesKvpressInTheModelLoop) {
  const auto& fx = cam_fixtures();
  ASSERT_TRUE(fx.error.empty()) << fx.error;
  ASSERT_EQ(fx.manifest.at("kvpress_version").get<std::string>(), "0.5.5");
  const LlamaModel& model = tiny_model();
  const std::string inputs = fx.manifest.at("inputs").get<std::string>();
  const at::Tensor context = fixture(inputs, "context_ids"), question = fixture(inputs, "question_ids");
  ASSERT_GE(fx.manifest.at("runs").size(), 3u);
  for (const auto& jr : fx.manifest.at("runs")) {
    const std::string name = jr.at("name").get<std::string>(), file = jr.at("file").get<std::string>();
    SCOPED_TRACE(name);
    const auto built = kvpress::make_press("CAMPress", 0.0, jr.at("params").get<std::map<std::string, std::string>>());
    const auto& press = dynamic_cast<const CAMPress&>(*built);
    const bool eager = jr.at("attn_implementation").get<std::string>() == "eager";
    KVCache cache = model.new_cache();
    model.prefill(context, cache);
    kvpress::DecodingState state;
    ForwardOptions step;
    step.last_logits_only = true;
    step.press = &press;
    step.press_state = &state;
    step.decoding_attentions = eager;  // kvpress on an eager model reads the model's weights
    at::manual_seed(fx.manifest.at("seed").get<int64_t>());
    const at::Tensor tokens = fixture(file, "tokens"), ref_logits = fixture(file, "logits");
    double max_diff = (model.forward(question, cache, step).logits[0][0] - ref_logits[0]).abs().max().item<double>();
    for (int64_t i = 0; i < tokens.size(0); ++i) {
      const at::Tensor logits = model.forward(tokens.narrow(0, i, 1).view({1, 1}), cache, step).logits[0][0];
      max_diff = std::max(max_diff, (logits - ref_logits[i + 1]).abs().max().item<double>());
    }
    EXPECT_LT(max_diff, 1e-4);
    double values_diff = 0;
    for (int64_t l = 0; l < model.config().num_layers; ++l) {
      const at::Tensor ref_keys = fixture(file, "keys_" + std::to_string(l));
      ASSERT_EQ(cache.length(l), ref_keys.size(2)) << "layer " << l;
      EXPECT_LT((cache.keys(l) - ref_keys).abs().max().item<double>(), 1e-5) << "layer " << l;
      values_diff = std::max(
          values_diff, (cache.values(l) - fixture(file, "values_" + std::to_string(l))).abs().max().item<double>());
    }
    EXPECT_LT(values_diff, 1e-5);
    std::cout << "[ cam ] " << std::left << std::setw(24) << name << " final caches of " << cache.length(0)
              << " tokens, max |d values| " << values_diff << ", max |d logits| " << max_diff << "\n";
  }
}

}  // namespace
