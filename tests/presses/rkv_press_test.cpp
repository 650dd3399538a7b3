// RKVPress against R-KV's definition (the authors' R1KV.update_kv and cal_similarity), computed
// directly in float64 with loops over rows: the importance (group max of the logits before the
// softmax, window mean, max pooling) and the redundancy (cosine similarities, diagonal and one
// retained column zeroed per row, row mean, softmax over columns), mixed by mix_lambda.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvpress/llama/generation.h"
#include "kvpress/presses/rkv_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::LayerInputs;
using kvpress::RKVPress;
using kvpress::testing::expect_error;
using kvpress::testing::randn;

constexpr int64_t kKvHeads = 2, kGroup = 2, kDim = 16;

// Keys with near-duplicates: every third position leans on one of four shared directions, so
// many rows have columns above the 0.5 threshold and the others mostly none.
at::Tensor clustered_keys(int64_t batch, int64_t seq, uint64_t seed) {
  at::Tensor keys = randn({batch, kKvHeads, seq, kDim}, seed);
  const at::Tensor directions = randn({batch, kKvHeads, 4, kDim}, seed + 1) * 2.0;
  for (int64_t s = 0; s < seq; s += 3) keys.select(2, s).add_(directions.select(2, (s / 3) % 4));
  return keys;
}

LayerInputs random_layer(int64_t batch, int64_t seq, uint64_t seed) {
  LayerInputs in;
  in.keys = clustered_keys(batch, seq, seed);
  in.values = randn({batch, kKvHeads, seq, kDim}, seed + 2);
  in.queries = randn({batch, kKvHeads * kGroup, seq, kDim}, seed + 3);  // every position
  return in;
}

// The authors' cal_similarity for one batch row, float64: [Hkv, S].
at::Tensor reference_redundancy(const at::Tensor& keys, const std::string& direction, double retain_ratio) {
  const at::Tensor k = keys.to(at::kDouble);  // [Hkv, S, D]
  const at::Tensor unit = k / (k.norm(2, -1, true) + 1e-8);
  at::Tensor sim = at::matmul(unit, unit.transpose(1, 2));  // [Hkv, S, S]
  const int64_t heads = sim.size(0), seq = sim.size(1);
  const auto rank = static_cast<int64_t>(static_cast<double>(seq) * retain_ratio);
  auto a = sim.accessor<double, 3>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < seq; ++i) a[h][i][i] = 0.0;
    for (int64_t i = 0; i < seq; ++i) {
      std::vector<int64_t> indices;  // torch.where(mask, column, 0) of the row
      for (int64_t j = 0; j < seq; ++j) indices.push_back(a[h][i][j] > 0.5 ? j : 0);
      std::vector<int64_t> sorted = indices;
      std::sort(sorted.begin(), sorted.end());
      int64_t retained = sorted.back();                     // "last", and last_percent's topk[0]
      if (direction == "first") retained = sorted.front();  // min
      if (direction == "first_percent") retained = sorted[static_cast<size_t>(rank - 1)];  // topk(largest=False)[-1]
      a[h][i][retained] = 0.0;
    }
  }
  return at::softmax(sim.mean(1), -1);
}

// R1KV's importance for one batch row, float64: [Hkv, S - w].
at::Tensor reference_importance(const LayerInputs& in, int64_t b, int64_t window, int64_t kernel) {
  const int64_t seq = in.keys.size(2), past = seq - window;
  const at::Tensor q = in.queries[b].narrow(1, in.queries.size(2) - window, window).to(at::kDouble);  // [Hq, w, D]
  const at::Tensor k = in.keys[b].narrow(1, 0, past).to(at::kDouble);                                 // [Hkv, n, D]
  at::Tensor out = at::empty({kKvHeads, past}, at::kDouble);
  for (int64_t h = 0; h < kKvHeads; ++h) {
    at::Tensor logits = at::full({window, past}, -std::numeric_limits<double>::infinity(), at::kDouble);
    for (int64_t g = 0; g < kGroup; ++g)
      logits = at::maximum(logits, at::matmul(q[h * kGroup + g], k[h].t()) / std::sqrt(double{kDim}));
    const at::Tensor mean = at::softmax(logits, -1).mean(0);  // [n]
    for (int64_t j = 0; j < past; ++j) {
      const int64_t lo = std::max<int64_t>(0, j - kernel / 2), hi = std::min(past, j + kernel / 2 + 1);
      out[h][j] = mean.narrow(0, lo, hi - lo).max();
    }
  }
  return out;
}

// Largest |got - expected| over the largest |expected|.
double relative_error(const at::Tensor& got, const at::Tensor& expected) {
  return (got.to(at::kDouble) - expected).abs().max().item<double>() / expected.abs().max().item<double>();
}

TEST(RKVPress, ImportanceAndRedundancyAreTheAuthorsDefinitions) {
  const LayerInputs in = random_layer(2, 40, 11);
  for (const std::string direction : {"last", "first", "last_percent", "first_percent"}) {
    RKVPress::Params params;
    params.retain_direction = direction;
    params.retain_ratio = 0.1;  // first_percent: the 4th smallest entry of each row
    const RKVPress press(0.5, params);
    const at::Tensor redundancy = press.redundancy(in.keys);  // [B, Hkv, S]
    for (int64_t b = 0; b < 2; ++b) {
      // float32 dot products of unit vectors (error ~1e-7) against float64, through a softmax of means.
      EXPECT_LE(relative_error(redundancy[b], reference_redundancy(in.keys[b], direction, 0.1)), 1e-5) << direction;
    }
  }
  // The keys have similar columns: which one is retained changes the redundancy.
  RKVPress::Params first;
  first.retain_direction = "first";
  EXPECT_GT((RKVPress(0.5).redundancy(in.keys) - RKVPress(0.5, first).redundancy(in.keys)).abs().max().item<double>(),
            1e-4 * RKVPress(0.5).redundancy(in.keys).max().item<double>());
  const RKVPress press(0.5);
  const at::Tensor importance = press.importance(in, 8);
  for (int64_t b = 0; b < 2; ++b) EXPECT_LE(relative_error(importance[b], reference_importance(in, b, 8, 7)), 1e-5);
}

TEST(RKVPress, ScoreMixesTheTermsAndKeepsTheWindow) {
  const LayerInputs in = random_layer(2, 40, 21);
  const RKVPress press(0.5, /*window_size=*/6, /*kernel_size=*/3, /*mix_lambda=*/0.3);
  const at::Tensor scores = press.score(in);
  ASSERT_EQ(scores.sizes(), (std::vector<int64_t>{2, kKvHeads, 40}));
  for (int64_t b = 0; b < 2; ++b) {
    const at::Tensor expected =
        0.3 * reference_importance(in, b, 6, 3) - 0.7 * reference_redundancy(in.keys[b], "last", 0.1).narrow(1, 0, 34);
    EXPECT_LE(relative_error(scores[b].narrow(1, 0, 34), expected), 1e-5);
    const at::Tensor top = std::get<0>(scores[b].narrow(1, 0, 34).max(1, true)) + 1.0;
    EXPECT_TRUE(at::allclose(scores[b].narrow(1, 34, 6), top.expand({-1, 6})));
  }
  // The kept set: the window and the best S/2 - 6 past positions of each head.
  const kvpress::KV kv = press.compress(in);
  const at::Tensor kept = kv.kept_indices;  // [B, Hkv, 20]
  ASSERT_EQ(kept.size(2), 20);
  EXPECT_TRUE(at::equal(kept.narrow(2, 14, 6), at::arange(34, 40).expand({2, kKvHeads, 6})));
}

// No [S, S] tensor: the similarities come a block of rows at a time once B·Hkv·S² > 2^21 entries.
TEST(RKVPress, BlocksOfRowsGiveTheWholeMatrixRedundancy) {
  const at::Tensor keys = clustered_keys(1, 1100, 31);  // 2 heads x 1100²: blocks of 953 rows
  const at::Tensor got = RKVPress(0.5).redundancy(keys);
  EXPECT_LE(relative_error(got[0], reference_redundancy(keys[0], "last", 0.1)), 1e-5);
}

TEST(RKVPress, WindowIsClampedToTheQueryRowsGivenAndToS) {
  LayerInputs in = random_layer(1, 40, 41);
  const at::Tensor all_rows = RKVPress(0.5, /*window_size=*/4).score(in);
  in.queries = in.queries.narrow(2, 36, 4);  // 4 rows: the window is 4, not 8
  EXPECT_TRUE(at::allclose(RKVPress(0.5).score(in), all_rows));
  // S <= w: every position is the window's, scored alike.
  const LayerInputs short_layer = random_layer(1, 6, 43);
  EXPECT_TRUE(at::equal(RKVPress(0.5).score(short_layer), at::zeros({1, kKvHeads, 6})));
}

TEST(RKVPress, RefusesParametersOutsideTheirRanges) {
  expect_error([] { RKVPress(0.5, 8, 7, 1.5); }, {"RKVPress: mix_lambda must be in [0, 1], got 1.5"});
  expect_error([] { RKVPress(0.5, 8, 6); }, {"RKVPress: kernel_size must be a positive odd number, got 6"});
  RKVPress::Params params;
  params.retain_direction = "middle";
  expect_error([&] { RKVPress(0.5, params); }, {"RKVPress", "retain_direction", "middle"});
  params.retain_direction = "first_percent";
  const LayerInputs in = random_layer(1, 9, 51);  // int(9 * 0.1) = 0 rows
  expect_error([&] { RKVPress(0.5, params).score(in); },
               {"RKVPress: retain_direction first_percent needs int(S * retain_ratio) >= 1, got S = 9"});
  LayerInputs no_queries = in;
  no_queries.queries = at::Tensor();
  expect_error([&] { RKVPress(0.5).score(no_queries); }, {"RKVPress"});
}

TEST(RKVPress, RegistryBuildsItFromItsDeclaration) {
  const kvpress::PressInfo* info = kvpress::find_press("RKVPress");
  ASSERT_NE(info, nullptr);
  ASSERT_EQ(info->params.size(), 5u);
  EXPECT_EQ(info->params[4].name, "retain_direction");
  const auto built = kvpress::make_press("RKVPress", 0.25, {{"window_size", "4"}, {"mix_lambda", "0.5"}});
  const LayerInputs in = random_layer(1, 30, 61);
  EXPECT_TRUE(at::equal(dynamic_cast<const RKVPress&>(*built).score(in), RKVPress(0.25, 4, 7, 0.5).score(in)));
}

// The authors' schedule in the runner: DecodingPress compresses every interval to the budget, its
// inner RKVPress scoring with the last 8 buffered queries.
TEST(RKVPress, CompressesWhileDecodingInsideDecodingPress) {
  const kvpress::llama::LlamaModel& model = kvpress::testing::tiny_model();
  std::vector<int64_t> context{1};
  for (int64_t i = 0; i < 59; ++i) context.push_back(300 + (i * 37) % 200);
  const auto press = kvpress::make_press("DecodingPress", 0.0,
                                         {{"press", "RKVPress"},
                                          {"compression_interval", "8"},
                                          {"target_size", "32"},
                                          {"hidden_states_buffer_size", "8"}});
  kvpress::llama::GenerationOptions opt;
  opt.max_new_tokens = 18;
  opt.stop_at_eos = false;
  opt.press = press.get();
  const auto g = kvpress::llama::generate_greedy(model, context, {400, 401}, opt);
  EXPECT_EQ(g.cache_lengths, (std::vector<int64_t>{60, 60}));  // nothing at prefill
  ASSERT_EQ(g.tokens.size(), 18u);
  // Forwards: the question, then 17 tokens; compressions after forwards 8 and 16 -> 32 + 2.
  EXPECT_EQ(g.final_cache_lengths, (std::vector<int64_t>{34, 34}));
}

}  // namespace
