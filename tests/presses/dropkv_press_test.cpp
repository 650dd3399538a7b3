// DropKVPress against its definition, computed directly in float64: the squared change of each
// window query's attention output when one token is evicted alone (the softmax renormalised over
// the others), summed over the window and averaged over the GQA group.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kvpress/presses/dropkv_press.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace {

using kvpress::DropKVPress;
using kvpress::LayerInputs;
using kvpress::testing::expect_error;
using kvpress::testing::randn;

constexpr int64_t kBatch = 2, kKvHeads = 2, kGroup = 2, kSeq = 40, kDim = 16;

LayerInputs random_layer(uint64_t seed) {
  LayerInputs in;
  in.keys = randn({kBatch, kKvHeads, kSeq, kDim}, seed);
  in.values = randn({kBatch, kKvHeads, kSeq, kDim}, seed + 1);
  in.queries = randn({kBatch, kKvHeads * kGroup, kSeq, kDim}, seed + 2);  // every position
  return in;
}

// Causal attention probabilities of the last `window` queries over all keys, float64,
// [B, Hq, window, S]; `evicted` >= 0 drops that key from every row's softmax.
at::Tensor probabilities(const LayerInputs& in, int64_t window, int64_t evicted = -1) {
  const at::Tensor q = in.queries.narrow(2, kSeq - window, window).to(at::kDouble);
  const at::Tensor k = in.keys.to(at::kDouble).repeat_interleave(kGroup, 1);
  at::Tensor logits = at::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(kDim));
  at::Tensor hidden = at::ones({window, kSeq}, at::kBool).triu(kSeq - window + 1);
  if (evicted >= 0) hidden.select(1, evicted).fill_(true);
  return at::softmax(logits.masked_fill(hidden, -std::numeric_limits<double>::infinity()), -1);
}

// The definition: Σ_i ‖o_i^(-j) − o_i‖², group mean, no pooling, for every position j.
at::Tensor direct_scores(const LayerInputs& in, int64_t window) {  // -> [B, Hkv, S] float64
  const at::Tensor v = in.values.to(at::kDouble).repeat_interleave(kGroup, 1);
  const at::Tensor out = at::matmul(probabilities(in, window), v);
  at::Tensor scores = at::empty({kBatch, kKvHeads * kGroup, kSeq}, at::kDouble);
  for (int64_t j = 0; j < kSeq; ++j) {
    scores.select(2, j).copy_((at::matmul(probabilities(in, window, j), v) - out).square().sum({2, 3}));
  }
  return scores.view({kBatch, kKvHeads, kGroup, kSeq}).mean(2);
}

TEST(DropKVPress, ScoreIsTheOutputPerturbationOfEvictingEachTokenAlone) {
  const LayerInputs in = random_layer(11);
  const int64_t window = 8;
  const at::Tensor expected = direct_scores(in, window);
  const at::Tensor got = DropKVPress(0.5, window, /*kernel_size=*/1, /*epsilon=*/1e-6).score(in).to(at::kDouble);
  ASSERT_EQ(got.sizes(), expected.sizes());
  // float32 GEMMs over S terms against float64, plus epsilon's relative 1e-6 / (1 - p).
  const double scale = expected.abs().max().item<double>();
  const at::Tensor outside = got.narrow(2, 0, kSeq - window), ref = expected.narrow(2, 0, kSeq - window);
  EXPECT_LE((outside - ref).abs().max().item<double>(), 1e-5 * scale);
  // The window is always kept: its scores are the maximum (window included) plus one.
  const at::Tensor top = std::get<0>(outside.max(2, /*keepdim=*/true));  // per batch row and head
  EXPECT_TRUE(at::all(got.narrow(2, kSeq - window, window) >= top + 1 - 1e-5 * scale).item<bool>());
}

TEST(DropKVPress, PoolsLikeSnapKVAndProtectsTheWindow) {
  const LayerInputs in = random_layer(21);
  const int64_t window = 6, kernel = 5;
  const at::Tensor unpooled = direct_scores(in, window).to(at::kFloat);
  // Zero padded, the padding counted: (s[j-2] + ... + s[j+2]) / 5.
  const at::Tensor padded = at::constant_pad_nd(unpooled, {kernel / 2, kernel / 2});
  at::Tensor pooled = at::zeros_like(unpooled);
  for (int64_t o = 0; o < kernel; ++o) pooled += padded.narrow(2, o, kSeq) / static_cast<double>(kernel);
  const at::Tensor got = DropKVPress(0.5, window, kernel).score(in);
  const double scale = pooled.abs().max().item<double>();
  EXPECT_LE((got.narrow(2, 0, kSeq - window) - pooled.narrow(2, 0, kSeq - window)).abs().max().item<double>(),
            1e-5 * scale);
  const at::Tensor protect = std::get<0>(pooled.max(2, /*keepdim=*/true)) + 1;
  EXPECT_TRUE(at::allclose(got.narrow(2, kSeq - window, window), protect.expand({-1, -1, window}), 1e-5, 1e-5 * scale));
}

TEST(DropKVPress, AttentionsAndQueriesGiveTheSameScores) {
  const LayerInputs in = random_layer(31);
  LayerInputs with_attentions;
  with_attentions.keys = in.keys;
  with_attentions.values = in.values;
  with_attentions.attentions = probabilities(in, kSeq).to(at::kFloat);  // every row [B, Hq, S, S]
  const DropKVPress press(0.5);
  const at::Tensor a = press.score(with_attentions), q = press.score(in);
  EXPECT_TRUE(at::allclose(a, q, 1e-4, 1e-5 * q.abs().max().item<double>()));
}

TEST(DropKVPress, WindowIsClampedToTheQueryRowsGiven) {
  LayerInputs in = random_layer(41);
  in.queries = in.queries.narrow(2, kSeq - 4, 4);  // 4 rows: the window is 4, not 32
  const at::Tensor got = DropKVPress(0.5, /*window_size=*/32, /*kernel_size=*/1).score(in);
  LayerInputs full = random_layer(41);
  const at::Tensor four = DropKVPress(0.5, /*window_size=*/4, /*kernel_size=*/1).score(full);
  EXPECT_TRUE(at::allclose(got, four));
  EXPECT_GT(got.narrow(2, kSeq - 4, 4).min().item<double>(), got.narrow(2, 0, kSeq - 4).max().item<double>());
}

TEST(DropKVPress, RefusesParametersOutsideTheirRanges) {
  expect_error([] { DropKVPress(0.5, 32, 7, 0.0); }, {"DropKVPress: epsilon must be > 0, got 0"});
  expect_error([] { DropKVPress(0.5, 32, 4); }, {"DropKVPress: kernel_size must be a positive odd number, got 4"});
  expect_error([] { DropKVPress(0.5, 0); }, {"DropKVPress: window_size must be > 0, got 0"});
}

TEST(DropKVPress, RegistryBuildsItFromItsDeclaration) {
  const kvpress::PressInfo* info = kvpress::find_press("DropKVPress");
  ASSERT_NE(info, nullptr);
  ASSERT_EQ(info->params.size(), 3u);
  EXPECT_EQ(info->params[2].name, "epsilon");
  EXPECT_EQ(info->params[2].accepts, "> 0");
  const auto built = kvpress::make_press("DropKVPress", 0.25, {{"window_size", "4"}, {"kernel_size", "1"}});
  const LayerInputs in = random_layer(51);
  EXPECT_TRUE(at::equal(dynamic_cast<const DropKVPress&>(*built).score(in), DropKVPress(0.25, 4, 1).score(in)));
  expect_error(
      [] {
        kvpress::make_press("DropKVPress", 0.5, {{"epsilon", "0"}});
      },
      {"DropKVPress: epsilon must be > 0, got 0"});
}

}  // namespace
