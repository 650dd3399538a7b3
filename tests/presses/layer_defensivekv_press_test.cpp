// LayerDefensiveKVPress on the Llama runner: its prefill keeps the int(N (1 - ratio) Hkv L) best
// (layer, head, position) triples of the per-layer DefensiveKVPress scores, computed here from a
// captured prefill of the same context (each layer's press inputs); layers and heads keep different
// counts, the window stays, and the greedy tokens follow the compressed cache.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "kvpress/llama/llama.h"
#include "kvpress/presses/layer_defensivekv_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::DefensiveKVPress;
using kvpress::LayerDefensiveKVPress;
using kvpress::testing::expect_error;

// The first n tokens of a story (BOS first), the story repeated as often as n needs.
at::Tensor story_ids(int64_t n) {
  const std::vector<int64_t> story = kvpress::testing::tiny_tokenizer().encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
      "dog Max. One day, Lily and Max went to the park. They saw a big tree with red apples. Lily wanted an "
      "apple, but the tree was too tall. Max barked at the tree and an apple fell down. Lily was so happy!",
      true);
  std::vector<int64_t> ids = story;
  while (static_cast<int64_t>(ids.size()) < n) ids.insert(ids.end(), story.begin() + 1, story.end());
  ids.resize(static_cast<size_t>(n));
  return at::tensor(ids, at::kLong).unsqueeze(0);
}

TEST(LayerDefensiveKVPress, KeepsTheBestTriplesAcrossLayersOfEachLayersScores) {
  const kvpress::llama::LlamaModel& model = kvpress::testing::tiny_model();
  const at::Tensor ids = story_ids(64);
  const int64_t n = ids.size(1), window = 16;
  const double ratio = 0.6;
  const LayerDefensiveKVPress press(ratio, window, 5);
  // The definition: each layer's DefensiveKVPress scores from its captured press inputs.
  const kvpress::llama::CapturedPrefill captured = model.capture_prefill(ids, {});
  std::vector<at::Tensor> layer_scores;
  for (const kvpress::LayerInputs& in : captured.layers)
    layer_scores.push_back(DefensiveKVPress(ratio, window, 5).score(in)[0]);
  const at::Tensor scores = at::stack(layer_scores);  // [L, Hkv, N]
  const std::vector<at::Tensor> expected = press.keep_masks(scores);

  kvpress::llama::KVCache cache = model.new_cache();
  kvpress::llama::PrefillOptions opt;
  opt.press = &press;
  const kvpress::llama::ForwardOutput out = model.prefill(ids, cache, opt);
  ASSERT_EQ(out.keep_masks.size(), expected.size());
  const int64_t layers = static_cast<int64_t>(expected.size()), heads = scores.size(1);
  int64_t kept = 0;
  for (int64_t l = 0; l < layers; ++l) {
    EXPECT_TRUE(at::equal(out.keep_masks[static_cast<size_t>(l)], expected[static_cast<size_t>(l)])) << "layer " << l;
    EXPECT_TRUE(expected[static_cast<size_t>(l)].narrow(2, n - window, window).all().item<bool>()) << "layer " << l;
    kept += expected[static_cast<size_t>(l)].sum().item<int64_t>();
  }
  EXPECT_EQ(kept, static_cast<int64_t>(static_cast<double>(n) * (1.0 - ratio) * heads * layers));
  // The selection spans layers: they keep different amounts (unlike DefensiveKVPress's per layer).
  EXPECT_NE(expected[0].sum().item<int64_t>(), expected[1].sum().item<int64_t>());
  // Every kept triple scores at least every evicted one.
  const at::Tensor mask = at::cat(expected, 0);
  EXPECT_GE(scores.masked_select(mask).min().item<float>(),
            scores.masked_select(mask.logical_not()).max().item<float>());
}

TEST(LayerDefensiveKVPress, NeedsEveryLayer) {
  const kvpress::LayerInputs one;
  expect_error([&] { LayerDefensiveKVPress(0.5).compress(one); },
               {"LayerDefensiveKVPress.compress: the selection spans every layer"});
  expect_error([] { LayerDefensiveKVPress(1.0); }, {"LayerDefensiveKVPress", "compression_ratio"});
  expect_error(
      [] {
        kvpress::make_press("LayerDefensiveKVPress", 0.5, {{"window_size", "0"}});
      },
      {"LayerDefensiveKVPress", "window_size"});
  // The runner runs its pass; a batch of two is refused, as the authors' code does.
  const kvpress::llama::LlamaModel& model = kvpress::testing::tiny_model();
  kvpress::llama::KVCache cache = model.new_cache();
  kvpress::llama::PrefillOptions opt;
  const LayerDefensiveKVPress press(0.5, 8, 5);
  opt.press = &press;
  expect_error([&] { model.prefill(story_ids(32).repeat({2, 1}), cache, opt); }, {"batch 1"});
}

}  // namespace
