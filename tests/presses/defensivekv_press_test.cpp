// DefensiveKVPress against its definition (include/kvpress/presses/defensivekv_press.h), computed
// directly in float64 with loops where the press uses fused tensor code: the window attention and
// its bias, the pooling, the defensive maximum, the value norm shares, stage 1 (with the authors'
// clamp, a negative one included) and the window; then the selection across heads.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvpress/presses/defensivekv_press.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace {

using kvpress::DefensiveKVPress;
using kvpress::LayerInputs;
using kvpress::testing::expect_error;
using kvpress::testing::randn;

constexpr int64_t kBatch = 2, kKvHeads = 2, kGroup = 2, kDim = 8, kHidden = 12;

LayerInputs random_layer(int64_t seq, uint64_t seed) {
  LayerInputs in;
  in.keys = randn({kBatch, kKvHeads, seq, kDim}, seed);
  in.values = randn({kBatch, kKvHeads, seq, kDim}, seed + 1);
  in.queries = randn({kBatch, kKvHeads * kGroup, seq, kDim}, seed + 2) * 2.0;  // peaked attention
  in.o_proj = randn({kHidden, kKvHeads * kGroup * kDim}, seed + 3);
  in.num_heads = kKvHeads * kGroup;
  return in;
}

// The definition's scores [B, Hkv, S] in float64.
at::Tensor defined_scores(const LayerInputs& in, double ratio, int64_t w, int64_t kernel) {
  const int64_t seq = in.keys.size(2), n = seq - w, hq = kKvHeads * kGroup;
  // 1. The window rows' causal softmax over all keys, per query head: [B, Hq, w, S].
  const at::Tensor q = in.queries.narrow(2, n, w).to(at::kDouble);
  const at::Tensor k = in.keys.to(at::kDouble).repeat_interleave(kGroup, 1);
  const at::Tensor logits = at::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(kDim));
  const at::Tensor hidden = at::ones({w, seq}, at::kBool).triu(n + 1);
  const at::Tensor p = at::softmax(logits.masked_fill(hidden, -std::numeric_limits<double>::infinity()), -1);
  const double bias = p.narrow(3, n - std::min(w, n), std::min(w, n)).sum(-1).mean().item<double>();
  const at::Tensor weights = p.narrow(3, 0, n);  // [B, Hq, w, n]
  at::Tensor scores = at::zeros({kBatch, kKvHeads, n}, at::kDouble);
  at::Tensor attention = at::zeros({kBatch, kKvHeads, n}, at::kDouble);  // group and row mean
  // 4's value norms: L1 of v W_o^h per query head, group mean.
  const at::Tensor wo = in.o_proj.to(at::kDouble);
  at::Tensor norms = at::zeros({kBatch, kKvHeads, n}, at::kDouble);
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < kKvHeads; ++h)
      for (int64_t j = 0; j < n; ++j) {
        double worst = -1.0, mean = 0.0, norm = 0.0;
        for (int64_t g = 0; g < kGroup; ++g) {
          const int64_t head = h * kGroup + g;
          const at::Tensor v = in.values[b][h][j].to(at::kDouble);
          norm += (wo.narrow(1, head * kDim, kDim).matmul(v)).abs().sum().item<double>() / kGroup;
          for (int64_t r = 0; r < w; ++r) {
            const at::Tensor row = weights[b][head][r];
            double pooled = 0.0, pooled_sum = 0.0;  // 2. zero padded, padding counted
            for (int64_t t = j - kernel / 2; t <= j + kernel / 2; ++t)
              if (t >= 0 && t < n) pooled += row[t].item<double>() / kernel;
            for (int64_t c = 0; c < n; ++c)
              for (int64_t t = c - kernel / 2; t <= c + kernel / 2; ++t)
                if (t >= 0 && t < n) pooled_sum += row[t].item<double>() / kernel;
            worst = std::max(worst, pooled / pooled_sum * row.sum().item<double>());
            mean += row[j].item<double>() / static_cast<double>(kGroup * w);
          }
        }
        scores[b][h][j] = worst;
        attention[b][h][j] = mean;
        norms[b][h][j] = norm;
      }
  scores = at::maximum(scores, scores.mean(-1, true));  // 3. floored at the mean
  scores = scores * norms / norms.sum(1, true);         // 4. the share among the layer's heads
  // 5. Stage 1 per head, then the window; both at the layer's maximum.
  const double top = scores.max().item<double>();
  const auto cap = static_cast<int64_t>(static_cast<double>(n) * (1.0 - ratio) - static_cast<double>(w));
  at::Tensor out = at::full({kBatch, kKvHeads, seq}, top, at::kDouble);
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < kKvHeads; ++h) {
      const at::Tensor a = attention[b][h] / attention[b][h].sum();
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) order[static_cast<size_t>(j)] = j;
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t x, int64_t y) { return a[x].item<double>() > a[y].item<double>(); });
      int64_t count = 0;
      double mass = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        mass += a[order[static_cast<size_t>(i)]].item<double>();
        if (mass >= 0.9 - bias) {
          count = i;
          break;
        }
      }
      count = std::min(count, cap);
      if (count < 0) count = std::max<int64_t>(0, n + count);
      out[b][h].narrow(0, 0, n).copy_(scores[b][h]);
      for (int64_t i = 0; i < count; ++i) out[b][h][order[static_cast<size_t>(i)]] = top;
    }
  return out;
}

TEST(DefensiveKVPress, ScoresAreTheDefinition) {
  // (S, w, ratio): a positive stage-1 cap, a cap of 2, a negative cap (-6: all but 6 forced).
  for (const auto& [seq, w, ratio] : {std::tuple{48, 8, 0.5}, std::tuple{40, 16, 0.25}, std::tuple{40, 16, 0.6}}) {
    SCOPED_TRACE("S " + std::to_string(seq) + ", w " + std::to_string(w) + ", ratio " + std::to_string(ratio));
    const LayerInputs in = random_layer(seq, 7 + seq + w);
    const at::Tensor expected = defined_scores(in, ratio, w, 5);
    const at::Tensor got = DefensiveKVPress(ratio, w, 5).score(in);
    ASSERT_EQ(got.sizes(), expected.sizes());
    // float32 softmax and sums over S terms against float64: relative 1e-5 of the layer's maximum.
    const double top = expected.max().item<double>();
    EXPECT_LT((got.to(at::kDouble) - expected).abs().max().item<double>(), 1e-5 * top);
    // Not vacuous: stage 1 forced some positions, and others kept their own scores.
    const int64_t forced = (expected.narrow(2, 0, seq - w) == top).sum().item<int64_t>();
    EXPECT_GT(forced, 0);
    EXPECT_LT(forced, kBatch * kKvHeads * (seq - w));
  }
}

// The window bias is the window rows' mass on the w positions just before the window (the authors'
// code), not on the window itself: given attention weights whose window rows put 0.5 on positions
// 12..15 (0.14, 0.13, 0.12, 0.11), 0.3 on the window and 0.2 on the rest, stage 1 aims at
// 0.9 - 0.5 = 0.4 of the normalised mass (0.2, 0.186, 0.171, 0.157, ...): positions 12 and 13 reach it
// (the third crosses, excluded). With the window's own mass (0.3) it would aim at 0.6 and force 14.
TEST(DefensiveKVPress, TheWindowBiasIsTheMassJustBeforeTheWindow) {
  constexpr int64_t seq = 20, w = 4, n = seq - w;
  LayerInputs in;
  in.keys = randn({1, kKvHeads, seq, kDim}, 5);
  in.values = randn({1, 1, seq, kDim}, 6).expand({1, kKvHeads, seq, kDim}).contiguous();  // equal shares
  in.o_proj = randn({kHidden, kKvHeads * kGroup * kDim}, 7);
  in.num_heads = kKvHeads * kGroup;
  at::Tensor row = at::full({seq}, 0.2 / 12, at::kFloat);
  row.narrow(0, 12, 4).copy_(at::tensor({0.14F, 0.13F, 0.12F, 0.11F}));
  row.narrow(0, n, w).zero_();
  row[n] = 0.3F;  // every window row sees the window's first position
  in.attentions = row.expand({1, kKvHeads * kGroup, seq, seq}).contiguous();
  const at::Tensor scores = DefensiveKVPress(0.25, w, 1).score(in)[0];  // cap int(16 · 0.75 - 4) = 8
  const float top = scores.max().item<float>();
  for (int64_t h = 0; h < kKvHeads; ++h) {
    EXPECT_EQ(scores[h][12].item<float>(), top);
    EXPECT_EQ(scores[h][13].item<float>(), top) << "stage 1 forces the second position";
    EXPECT_LT(scores[h][14].item<float>(), top) << "the third crosses 0.4 (0.557): not forced";
  }
}

TEST(DefensiveKVPress, KeepsTheBestPairsAcrossHeads) {
  const int64_t seq = 48, w = 8;
  const double ratio = 0.6;
  const LayerInputs in = random_layer(seq, 31);
  const DefensiveKVPress press(ratio, w, 5);
  const at::Tensor scores = press.score(in), mask = press.keep_mask(in);
  const auto kept = static_cast<int64_t>(seq * (1.0 - ratio) * kKvHeads);
  for (int64_t b = 0; b < kBatch; ++b) {
    EXPECT_EQ(mask[b].sum().item<int64_t>(), kept);
    // Every kept pair scores at least every evicted one; the window is kept in every head.
    EXPECT_GE(scores[b].masked_select(mask[b]).min().item<float>(),
              scores[b].masked_select(mask[b].logical_not()).max().item<float>());
    EXPECT_TRUE(mask[b].narrow(1, seq - w, w).all().item<bool>());
  }
  // Head-ragged: the heads keep different numbers of tokens.
  const at::Tensor per_head = mask.sum(-1);
  EXPECT_NE(per_head.min().item<int64_t>(), per_head.max().item<int64_t>());
  const kvpress::RaggedKV ragged = press.compress_ragged(in);
  EXPECT_EQ(ragged.heads[0].keys.size(0), per_head[0][0].item<int64_t>());
  EXPECT_TRUE(DefensiveKVPress(0.0, w, 5).keep_mask(in).all().item<bool>());
}

TEST(DefensiveKVPress, RefusesWhatItCannotScore) {
  LayerInputs in = random_layer(16, 3);
  expect_error([&] { DefensiveKVPress(0.5, 16, 5).score(in); },
               {"DefensiveKVPress: the sequence (16 tokens) must be longer than window_size (16)"});
  expect_error([&] { DefensiveKVPress(0.5, 4, 5).compress(in); }, {"DefensiveKVPress", "compress_ragged"});
  in.o_proj = at::Tensor();
  expect_error([&] { DefensiveKVPress(0.5, 4, 5).score(in); }, {"DefensiveKVPress: needs o_proj"});
  expect_error(
      [] {
        kvpress::make_press("DefensiveKVPress", 0.5, {{"kernel_size", "4"}});
      },
      {"DefensiveKVPress", "kernel_size"});
}

}  // namespace
