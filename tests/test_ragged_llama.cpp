// The Llama runner with head-ragged presses: layers stored packed (HeadRaggedLayer, attended by
// ops::ragged_attention) must give the logits of the same selection applied as -inf masking on
// the dense cache (RaggedLayout::kMasked, the ordinary matmul attention with a keep mask).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kvpress/llama/llama.h"
#include "kvpress/presses/compactor_press.h"
#include "kvpress/presses/keydiff_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/score_blend_press.h"
#include "test_util.h"

namespace kvpress {
namespace {

using llama::ForwardOptions;
using llama::KVCache;
using llama::LlamaModel;
using llama::PrefillOptions;
using testing::expect_error;
using Layout = PrefillOptions::RaggedLayout;

const LlamaModel& model(at::ScalarType dtype) {
  static const std::string dir = llama::resolve_model_dir("tinystories-656k");
  static const LlamaModel f32 = LlamaModel::load(dir);
  static const LlamaModel bf16 = LlamaModel::load(dir, at::kBFloat16);
  return dtype == at::kFloat ? f32 : bf16;
}

// Token ids from a fixed seed (the tokenizer is not under test here).
at::Tensor token_ids(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  return at::randint(3, 2000, {1, n}, at::kLong);
}

std::vector<std::shared_ptr<const BasePress>> ragged_presses() {
  ScoreBlendOptions blend;
  blend.sink_size_start = 2;
  blend.selection = TokenSelection::kAcrossHeads;
  return {std::make_shared<ScoreBlendPress>(0.6,
                                            std::vector<std::shared_ptr<const ScorerPress>>{
                                                std::make_shared<KnormPress>(0.6), std::make_shared<KeyDiffPress>(0.6)},
                                            std::vector<double>{1.0, 0.5}, blend),
          std::make_shared<CompactorPress>(0.5, 4, 2, 32, 16, std::nullopt, /*seed=*/0, TokenSelection::kAcrossHeads)};
}

struct RaggedRun {
  std::vector<at::Tensor> logits;  // prefill, question, then each decode step
  std::vector<at::Tensor> keep_masks;
  KVCache cache;
};

// Prefill 80 tokens with the press, a 7-token question, 4 single-token decode steps. The decode
// tokens are fixed (not greedy) so that both layouts always see the same inputs.
RaggedRun run_press(const BasePress& press, Layout layout, at::ScalarType dtype) {
  const LlamaModel& m = model(dtype);
  RaggedRun r{{}, {}, m.new_cache()};
  PrefillOptions opt;
  opt.press = &press;
  opt.ragged_layout = layout;
  const llama::ForwardOutput pre = m.prefill(token_ids(80, 1), r.cache, opt);
  r.logits.push_back(pre.logits);
  r.keep_masks = pre.keep_masks;
  EXPECT_TRUE(pre.kept_indices.empty());
  at::Tensor logits = m.forward(token_ids(7, 2), r.cache).logits;
  r.logits.push_back(logits);
  const at::Tensor decode_ids = token_ids(4, 3);
  for (int64_t step = 0; step < 4; ++step) {
    logits = m.forward(decode_ids.narrow(1, step, 1), r.cache).logits;
    r.logits.push_back(logits);
  }
  return r;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(RaggedLlama, PackedLayersMatchMaskedDenseCache) {
  for (const auto& press : ragged_presses()) {
    ASSERT_TRUE(press->head_ragged()) << press->name();
    const RaggedRun packed = run_press(*press, Layout::kPacked, at::kFloat);
    const RaggedRun masked = run_press(*press, Layout::kMasked, at::kFloat);
    ASSERT_EQ(packed.keep_masks.size(), 2u);
    for (size_t l = 0; l < 2; ++l) {
      EXPECT_TRUE(at::equal(packed.keep_masks[l], masked.keep_masks[l])) << press->name() << " layer " << l;
      ASSERT_TRUE(packed.cache.is_ragged(static_cast<int64_t>(l)));
      EXPECT_FALSE(masked.cache.is_ragged(static_cast<int64_t>(l)));
      const HeadRaggedLayer& layer = packed.cache.ragged(static_cast<int64_t>(l));
      // The selection really is ragged, and the layer holds exactly the kept tokens + 12 new ones.
      EXPECT_LT(layer.min_length(), layer.max_length()) << press->name();
      EXPECT_EQ(layer.appended(), 11);
      EXPECT_EQ(layer.packed_tokens(), packed.keep_masks[l].sum().item<int64_t>());
      EXPECT_TRUE(at::equal(layer.keep_mask().narrow(2, 0, 80), packed.keep_masks[l]));
      EXPECT_EQ(packed.cache.length(static_cast<int64_t>(l)), layer.max_length());
    }
    // Prefill attends over the full cache in both; afterwards only the storage differs.
    EXPECT_TRUE(at::equal(packed.logits[0], masked.logits[0])) << press->name();
    for (size_t i = 1; i < packed.logits.size(); ++i)
      EXPECT_LE(max_abs_diff(packed.logits[i], masked.logits[i]), 1e-4) << press->name() << " forward " << i;
    // The masked layout keeps all 91 tokens; the packed one about half of the 80.
    EXPECT_LT(packed.cache.bytes(), masked.cache.bytes() * 3 / 4) << press->name();
  }
}

TEST(RaggedLlama, PackedLayersMatchMaskedDenseCacheBfloat16) {
  const auto press = ragged_presses()[0];
  const RaggedRun packed = run_press(*press, Layout::kPacked, at::kBFloat16);
  const RaggedRun masked = run_press(*press, Layout::kMasked, at::kBFloat16);
  for (size_t l = 0; l < 2; ++l) EXPECT_TRUE(at::equal(packed.keep_masks[l], masked.keep_masks[l]));
  // The fused kernel keeps the attention in float32 where the dense path rounds the softmax
  // weights to bfloat16 before multiplying by V: logits (O(10)) differ by rounding only (measured:
  // at most 0.16, i.e. under 3 bfloat16 steps at that magnitude).
  for (size_t i = 1; i < packed.logits.size(); ++i) {
    EXPECT_LE(max_abs_diff(packed.logits[i], masked.logits[i]), 0.25) << "forward " << i;
  }
}

TEST(RaggedLlama, TruncateReusesTheCompressedContext) {
  // eval's protocol: compress a context once, answer, roll back, answer again.
  const auto press = ragged_presses()[1];
  const LlamaModel& m = model(at::kFloat);
  KVCache cache = m.new_cache();
  PrefillOptions opt;
  opt.press = press.get();
  m.prefill(token_ids(80, 1), cache, opt);
  const std::vector<int64_t> lengths = cache.lengths();
  const int64_t bytes = cache.bytes();
  const at::Tensor first = m.forward(token_ids(9, 3), cache).logits;
  m.forward(token_ids(1, 4), cache);
  cache.truncate(lengths, 80);
  EXPECT_EQ(cache.lengths(), lengths);
  EXPECT_EQ(cache.ragged(0).appended(), 0);
  const at::Tensor again = m.forward(token_ids(9, 3), cache).logits;
  EXPECT_TRUE(at::equal(first, again));
  EXPECT_GT(cache.bytes(), bytes);  // the tail buffer stays allocated for the next answer

  std::vector<int64_t> too_short = cache.lengths();
  too_short[0] -= 10;
  expect_error([&] { cache.truncate(too_short, 80); },
               {"KVCache::truncate: head-ragged layer 0 can drop at most the 9 tokens appended after compression"});
  ForwardOptions with_attn;
  with_attn.return_attentions = true;
  expect_error([&] { m.forward(token_ids(1, 5), cache, with_attn); },
               {"return_attentions is not available for layer 0, stored head-ragged"});
  expect_error([&] { cache.keys(0); }, {"KVCache::keys: layer 0 is stored head-ragged (use ragged(layer))"});
}

TEST(RaggedLlama, DenseLayersUnchanged) {
  // A per-head press keeps the dense path: no ragged layer, no keep mask, kept_indices filled.
  const LlamaModel& m = model(at::kFloat);
  KVCache cache = m.new_cache();
  KnormPress knorm(0.5);
  PrefillOptions opt;
  opt.press = &knorm;
  const auto out = m.prefill(token_ids(40, 1), cache, opt);
  EXPECT_EQ(out.kept_indices.size(), 2u);
  EXPECT_TRUE(out.keep_masks.empty());
  EXPECT_FALSE(cache.is_ragged(0));
  EXPECT_FALSE(cache.keep_mask(0).defined());
  expect_error([&] { cache.ragged(0); }, {"KVCache::ragged: layer 0 is not stored head-ragged"});
}

}  // namespace
}  // namespace kvpress
