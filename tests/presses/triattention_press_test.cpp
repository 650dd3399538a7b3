// TriAttentionPress: its scores against the authors' functions (a golden vector) and the definition,
// its calibration, its one selection for every layer while decoding, and the runners.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kvpress/llama/generation.h"
#include "kvpress/llama/model.h"
#include "kvpress/presses/triattention_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::DecodingUpdate;
using kvpress::LayerInputs;
using kvpress::TriAttentionPress;
using kvpress::testing::expect_error;

at::Tensor floats(std::vector<float> v) { return at::tensor(v, at::kFloat); }

// The authors' functions (pruning_utils.py at c3744ee6: invert_rope, compute_frequency_statistics_from_means,
// score_keys_for_round with aggregation "mean") on a small case, run with their code: D = 8.
TEST(TriAttentionPress, FrequencyScoresMatchTheAuthorsFunctions) {
  const at::Tensor keys = floats({.5f, -1,  .25f, 2,   1.5f, 0,    -.75f, 1,   //
                                  1,   1,   -1,   .5f, -.5f, 2,    0,     -1,  //
                                  -2,  .5f, 1,    1,   .25f, -.5f, 1.5f,  0})
                              .view({1, 3, 8});
  const at::Tensor positions = at::tensor({0, 3, 7}, at::kLong).view({1, 3});
  const at::Tensor scores = TriAttentionPress::frequency_scores(
      keys, positions, /*round_start=*/10, floats({1, -.5f, .25f, .1f}).view({1, 4}),
      floats({.5f, .5f, -.25f, 0}).view({1, 4}), floats({1.5f, 1, .5f, .2f}).view({1, 4}),
      floats({1, .1f, .01f, .001f}), floats({1, 2, 4, 8}), /*max_over_offsets=*/false);
  // Both sides in float32: phases up to (10 + 8) · 1 + pi rad carry <= 2^-23 · 22 rad of rounding,
  // times sum_f |q̄_f||K_f| <= 5 here: 2e-5 bounds the difference.
  const std::vector<double> expected{2.3445268, 0.4161666, 0.1314588};
  for (int64_t j = 0; j < 3; ++j) EXPECT_NEAR(scores[0][j].item<double>(), expected[j], 2e-5) << "key " << j;
}

// s_j by its definition in double: Re(q̄_f conj(K_f) e^{i (R - p + δ) ω_f}) summed over f, aggregated
// over δ, plus Σ_f (E|q_f| - |q̄_f|)|K_f|; K_f the post-RoPE key rotated back by p ω_f.
double defined_score(const at::Tensor& key, int64_t p, int64_t round_start, const at::Tensor& qr, const at::Tensor& qi,
                     const at::Tensor& qa, const at::Tensor& omega, const std::vector<double>& offsets, bool max) {
  const int64_t f = omega.size(0);
  double extra = 0, best = -1e300, sum = 0;
  std::vector<std::complex<double>> rel(static_cast<size_t>(f));
  for (int64_t i = 0; i < f; ++i) {
    const double w = omega[i].item<double>();
    const std::complex<double> k(key[i].item<double>(), key[i + f].item<double>());
    const std::complex<double> unrotated = k * std::polar(1.0, -static_cast<double>(p) * w);
    const std::complex<double> q(qr[i].item<double>(), qi[i].item<double>());
    rel[static_cast<size_t>(i)] = q * std::conj(unrotated);
    extra += (qa[i].item<double>() - std::abs(q)) * std::abs(unrotated);
  }
  for (double delta : offsets) {
    double s = extra;
    for (int64_t i = 0; i < f; ++i) {
      const double angle = (static_cast<double>(round_start - p) + delta) * omega[i].item<double>();
      s += (rel[static_cast<size_t>(i)] * std::polar(1.0, angle)).real();
    }
    best = std::max(best, s);
    sum += s;
  }
  return max ? best : sum / static_cast<double>(offsets.size());
}

TEST(TriAttentionPress, FrequencyScoresFollowTheirDefinition) {
  constexpr int64_t kKv = 2, kQ = 6, kDim = 16, kKeys = 12, kRound = 90;
  const at::Tensor keys = kvpress::testing::randn({kKv, kKeys, kDim}, 3);
  // Distinct per head, another set in each head.
  const at::Tensor positions =
      std::get<0>(at::sort(at::randperm(kRound, at::kLong).narrow(0, 0, kKv * kKeys).view({kKv, kKeys})));
  const at::Tensor qr = kvpress::testing::randn({kQ, kDim / 2}, 4), qi = kvpress::testing::randn({kQ, kDim / 2}, 5);
  const at::Tensor qa = at::hypot(qr, qi) + kvpress::testing::randn({kQ, kDim / 2}, 6).abs();
  const at::Tensor omega = at::pow(10000.0, -at::arange(0, kDim, 2, at::kFloat) / static_cast<double>(kDim));
  const at::Tensor offsets = TriAttentionPress::geometric_offsets(64);
  ASSERT_EQ(offsets.size(0), 7);
  const std::vector<double> deltas{1, 2, 4, 8, 16, 32, 64};
  for (bool max : {false, true}) {
    const at::Tensor got =
        TriAttentionPress::frequency_scores(keys, positions, kRound, qr, qi, qa, omega, offsets, max);
    ASSERT_EQ(got.sizes(), at::IntArrayRef({kQ, kKeys}));
    for (int64_t h = 0; h < kQ; ++h) {
      const int64_t g = h / (kQ / kKv);
      // float32 phases up to (kRound + 64) rad: 2^-22 · 160 rad of rounding (angle, un-rotation and
      // phase) times sum_f (|q̄_f| + E|q_f|)|K_f|, plus the float32 sums of the terms.
      const double weight = ((at::hypot(qr[h], qi[h]) + qa[h]) * keys[g].abs().sum(1).max()).sum().item<double>();
      const double tol = (0x1p-22 * 160 + 16 * 0x1p-24) * weight;
      for (int64_t j = 0; j < kKeys; ++j) {
        const double want =
            defined_score(keys[g][j], positions[g][j].item<int64_t>(), kRound, qr[h], qi[h], qa[h], omega, deltas, max);
        EXPECT_NEAR(got[h][j].item<double>(), want, tol) << "head " << h << " key " << j << (max ? " max" : " mean");
      }
    }
  }
}

TEST(TriAttentionPress, CalibrationIsTheMeanOfThePreRopeQueryPairs) {
  constexpr int64_t kHidden = 12, kQ = 4, kDim = 8, kSeq = 10;
  LayerInputs in;
  in.keys = kvpress::testing::randn({1, 2, kSeq, kDim}, 1);
  in.values = kvpress::testing::randn({1, 2, kSeq, kDim}, 2);
  in.hidden_states = kvpress::testing::randn({1, kSeq, kHidden}, 3);
  in.q_proj = kvpress::testing::randn({kQ * kDim, kHidden}, 4);
  in.num_heads = kQ;
  std::vector<LayerInputs> layers{in, in};
  layers[1].hidden_states = kvpress::testing::randn({1, kSeq, kHidden}, 5);
  const TriAttentionPress::Statistics s = TriAttentionPress::calibrate(layers);
  ASSERT_EQ(s.q_mean_real.sizes(), at::IntArrayRef({2, kQ, kDim / 2}));
  for (int64_t l = 0; l < 2; ++l) {
    const at::Tensor q =
        at::matmul(layers[static_cast<size_t>(l)].hidden_states[0], in.q_proj.t()).view({kSeq, kQ, kDim});
    for (int64_t h = 0; h < kQ; ++h)
      for (int64_t f = 0; f < kDim / 2; ++f) {
        double re = 0, im = 0, mod = 0;
        for (int64_t t = 0; t < kSeq; ++t) {
          const std::complex<double> z(q[t][h][f].item<double>(), q[t][h][f + kDim / 2].item<double>());
          re += z.real() / kSeq;
          im += z.imag() / kSeq;
          mod += std::abs(z) / kSeq;
        }
        EXPECT_NEAR(s.q_mean_real[l][h][f].item<double>(), re, 1e-5);
        EXPECT_NEAR(s.q_mean_imag[l][h][f].item<double>(), im, 1e-5);
        EXPECT_NEAR(s.q_abs_mean[l][h][f].item<double>(), mod, 1e-5);
      }
  }
  const kvpress::testing::TempDir dir;
  const std::string path = dir.path + "/stats.safetensors";
  TriAttentionPress::save_statistics(path, s);
  const TriAttentionPress::Statistics back = TriAttentionPress::load_statistics(path);
  EXPECT_TRUE(back.q_mean_real.equal(s.q_mean_real) && back.q_mean_imag.equal(s.q_mean_imag) &&
              back.q_abs_mean.equal(s.q_abs_mean));
}

// A model of kLayers layers whose key at (layer, position) is fixed, decoded one token at a time
// through decoding_update, with the authors' bookkeeping kept beside: each KV head's slots -> positions.
struct Decoder {
  static constexpr int64_t kLayers = 3, kKv = 2, kQ = 4, kDim = 8, kHidden = 4;
  at::Tensor keys;  // [kLayers, kKv, total, D]: the post-RoPE key of each position
  at::Tensor inv_freq = at::pow(10000.0, -at::arange(0, kDim, 2, at::kFloat) / static_cast<double>(kDim));
  std::vector<std::vector<int64_t>> slots;  // per KV head: the position in each cache slot

  explicit Decoder(int64_t total) : keys(kvpress::testing::randn({kLayers, kKv, total, kDim}, 11)) {}

  // Each head keeps the slots keep[0][h] [1, Hkv, k], as the engine's cache does.
  void keep(const at::Tensor& keep) {
    for (int64_t h = 0; h < kKv; ++h) {
      std::vector<int64_t> kept;
      for (int64_t j = 0; j < keep.size(2); ++j)
        kept.push_back(slots[static_cast<size_t>(h)][static_cast<size_t>(keep[0][h][j].item<int64_t>())]);
      slots[static_cast<size_t>(h)] = kept;
    }
  }
  at::Tensor cache(int64_t layer) const {  // [1, Hkv, L, D] as the slots say
    std::vector<at::Tensor> heads;
    for (int64_t h = 0; h < kKv; ++h)
      heads.push_back(keys[layer][h].index_select(0, at::tensor(slots[static_cast<size_t>(h)], at::kLong)));
    return at::stack(heads).unsqueeze(0);
  }
  LayerInputs forward(int64_t layer) const {
    LayerInputs in;
    in.keys = cache(layer);
    in.values = in.keys.clone();
    in.hidden_states = at::zeros({1, 1, kHidden});
    in.inv_freq = inv_freq;
    in.num_heads = kQ;
    in.layer_idx = layer;
    in.num_layers = kLayers;
    return in;
  }
};

TriAttentionPress::Statistics random_statistics(int64_t layers, int64_t heads, int64_t pairs, uint64_t seed) {
  const at::Tensor re = kvpress::testing::randn({layers, heads, pairs}, seed);
  const at::Tensor im = kvpress::testing::randn({layers, heads, pairs}, seed + 1);
  return {re, im, at::hypot(re, im) + kvpress::testing::randn({layers, heads, pairs}, seed + 2).abs()};
}

// The slots the paper's per-head selection keeps, computed here from the definition of the steps: the
// scores of the decoding slots per (layer, query head), z-scored, max over a KV head's query heads,
// mean over layers, the best (budget - prompt) per KV head, the prompt first.
std::vector<std::vector<int64_t>> expected_slots(const Decoder& d, const TriAttentionPress::Statistics& s,
                                                 int64_t prompt, int64_t budget, int64_t round_start) {
  const int64_t length = static_cast<int64_t>(d.slots[0].size()), m = length - prompt,
                group = Decoder::kQ / Decoder::kKv;
  std::vector<std::vector<double>> mean(Decoder::kKv, std::vector<double>(static_cast<size_t>(m), 0.0));
  for (int64_t l = 0; l < Decoder::kLayers; ++l) {
    std::vector<at::Tensor> rows;  // each head's decoding positions
    for (const std::vector<int64_t>& head : d.slots)
      rows.push_back(at::tensor(std::vector<int64_t>(head.begin() + prompt, head.end())));
    const at::Tensor positions = at::stack(rows);  // [Hkv, m]
    const at::Tensor scores = TriAttentionPress::frequency_scores(
        d.cache(l)[0].narrow(1, prompt, m), positions, round_start, s.q_mean_real[l], s.q_mean_imag[l], s.q_abs_mean[l],
        d.inv_freq, TriAttentionPress::geometric_offsets(65536), false);
    for (int64_t kv = 0; kv < Decoder::kKv; ++kv)
      for (int64_t j = 0; j < m; ++j) {
        double best = -1e300;
        for (int64_t q = kv * group; q < (kv + 1) * group; ++q) {
          const at::Tensor row = scores[q].to(at::kDouble);
          const double mu = row.mean().item<double>();
          const double sd = std::max(row.std(/*unbiased=*/false).item<double>(), 1e-6);
          best = std::max(best, (row[j].item<double>() - mu) / sd);
        }
        mean[static_cast<size_t>(kv)][static_cast<size_t>(j)] += best / Decoder::kLayers;
      }
  }
  std::vector<std::vector<int64_t>> kept;
  for (const std::vector<double>& row : mean) {
    std::vector<int64_t> order(static_cast<size_t>(m));
    for (int64_t j = 0; j < m; ++j) order[static_cast<size_t>(j)] = j;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return row[static_cast<size_t>(a)] > row[static_cast<size_t>(b)]; });
    std::vector<int64_t> slots;
    for (int64_t j = 0; j < prompt; ++j) slots.push_back(j);
    for (int64_t j = 0; j < budget - prompt; ++j) slots.push_back(prompt + order[static_cast<size_t>(j)]);
    std::sort(slots.begin(), slots.end());
    kept.push_back(slots);
  }
  return kept;
}

TEST(TriAttentionPress, SelectsOnceForEveryLayerPinsThePromptAndTracksEachHeadsPositions) {
  constexpr int64_t kPrompt = 6, kBudget = 10, kDivide = 4, kTotal = 40;
  const TriAttentionPress::Statistics stats = random_statistics(Decoder::kLayers, Decoder::kQ, Decoder::kDim / 2, 21);
  TriAttentionPress::Params p;
  p.budget = kBudget;
  p.divide_length = kDivide;
  const TriAttentionPress press(p, stats);
  EXPECT_TRUE(press.decoding_role().keeps_every_layer);
  EXPECT_EQ(press.prefill_press(), nullptr);
  Decoder d(kTotal);
  d.slots.assign(Decoder::kKv, {});
  for (int64_t t = 0; t < kPrompt; ++t)
    for (auto& head : d.slots) head.push_back(t);
  const auto state = press.new_sequence_state();
  int64_t compressions = 0;
  for (int64_t t = kPrompt; t < kTotal; ++t) {  // the forward of position t
    for (auto& head : d.slots) head.push_back(t);
    const int64_t length = static_cast<int64_t>(d.slots[0].size());
    const bool due = length >= kBudget + kDivide;
    const auto expected = due ? expected_slots(d, stats, kPrompt, kBudget, t + 1) : std::vector<std::vector<int64_t>>{};
    for (int64_t l = 0; l < Decoder::kLayers; ++l) {
      EXPECT_EQ(press.decoding_reads_cache(l, 1, t + 1, *state), due) << "t " << t << " layer " << l;
      const DecodingUpdate u = press.decoding_update(d.forward(l), t + 1, *state);
      const bool last = l == Decoder::kLayers - 1;
      ASSERT_EQ(u.kind, due && last ? DecodingUpdate::Kind::kKeepEveryLayer : DecodingUpdate::Kind::kNone)
          << "t " << t << " layer " << l;
      if (u.kind != DecodingUpdate::Kind::kKeepEveryLayer) continue;
      ASSERT_EQ(u.keep.sizes(), at::IntArrayRef({1, Decoder::kKv, kBudget}));
      for (int64_t h = 0; h < Decoder::kKv; ++h) {
        const at::Tensor row = u.keep[0][h].contiguous();
        const std::vector<int64_t> got(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + kBudget);
        EXPECT_EQ(got, expected[static_cast<size_t>(h)]) << "t " << t << " head " << h;
      }
      d.keep(u.keep);
      ++compressions;
    }
  }
  EXPECT_EQ(compressions, 7) << "at length 14: the forwards of positions 13, 17, ..., 37";
  EXPECT_NE(d.slots[0], d.slots[1]) << "the heads keep different tokens";
  const auto& own = dynamic_cast<const kvpress::TriAttentionState&>(*state);
  for (int64_t h = 0; h < Decoder::kKv; ++h) {
    const at::Tensor row = own.positions[h].contiguous();
    EXPECT_EQ(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel()),
              d.slots[static_cast<size_t>(h)]);
  }
}

// On a tensor-parallel rank holding KV head 1 of 2 (its query heads' statistics rows 2-3), the press
// keeps what the whole layer's run keeps in that head: the selection is per KV head.
TEST(TriAttentionPress, ARankOfTheHeadsKeepsWhatTheWholeLayerKeepsInThem) {
  TriAttentionPress::Params p;
  p.budget = 10;
  p.divide_length = 4;
  const TriAttentionPress press(p, random_statistics(Decoder::kLayers, Decoder::kQ, Decoder::kDim / 2, 31));
  Decoder d(30);
  d.slots.assign(Decoder::kKv, {0, 1, 2, 3, 4, 5});
  const auto whole = press.new_sequence_state(), rank = press.new_sequence_state();
  int64_t compared = 0;
  for (int64_t t = 6; t < 30; ++t) {
    for (auto& head : d.slots) head.push_back(t);
    for (int64_t l = 0; l < Decoder::kLayers; ++l) {
      LayerInputs shard = d.forward(l);
      shard.keys = shard.keys.narrow(1, 1, 1).contiguous();
      shard.values = shard.keys;
      shard.num_heads = Decoder::kQ / Decoder::kKv;
      shard.kv_head_range = {/*first=*/1, /*layer_kv_heads=*/Decoder::kKv};
      const DecodingUpdate on_rank = press.decoding_update(shard, t + 1, *rank);
      const DecodingUpdate u = press.decoding_update(d.forward(l), t + 1, *whole);
      ASSERT_EQ(on_rank.kind, u.kind) << "t " << t << " layer " << l;
      if (u.kind != DecodingUpdate::Kind::kKeepEveryLayer) continue;
      EXPECT_TRUE(on_rank.keep[0][0].equal(u.keep[0][1])) << "t " << t;
      d.keep(u.keep);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 5);
}

// The authors' quirk: a prompt of >= budget tokens keeps its first `budget` tokens and no decoding token.
TEST(TriAttentionPress, APromptOverTheBudgetKeepsItsFirstBudgetTokens) {
  TriAttentionPress::Params p;
  p.budget = 5;
  p.divide_length = 2;
  const TriAttentionPress press(p, random_statistics(Decoder::kLayers, Decoder::kQ, Decoder::kDim / 2, 3));
  Decoder d(10);
  d.slots.assign(Decoder::kKv, {0, 1, 2, 3, 4, 5, 6});  // a prompt of 6, then position 6
  const auto state = press.new_sequence_state();
  DecodingUpdate u;
  for (int64_t l = 0; l < Decoder::kLayers; ++l) u = press.decoding_update(d.forward(l), 7, *state);
  ASSERT_EQ(u.kind, DecodingUpdate::Kind::kKeepEveryLayer);
  EXPECT_TRUE(u.keep.equal(at::arange(5, at::kLong).expand({1, Decoder::kKv, 5})));
}

TEST(TriAttentionPress, RefusesWhatItCannotDo) {
  const TriAttentionPress::Statistics stats = random_statistics(Decoder::kLayers, Decoder::kQ, Decoder::kDim / 2, 5);
  TriAttentionPress::Params p;
  p.budget = 4;
  p.divide_length = 2;
  const TriAttentionPress press(p, stats);
  Decoder d(12);
  d.slots.assign(Decoder::kKv, {0, 1, 2, 3, 4, 5});
  EXPECT_TRUE(press.compress(d.forward(0)).kept_indices.equal(at::arange(6, at::kLong).expand({1, 2, 6})))
      << "nothing at prefill";
  {
    const TriAttentionPress none(p);
    const auto state = none.new_sequence_state();
    expect_error([&] { none.decoding_update(d.forward(0), 6, *state); },
                 {"TriAttentionPress.decoding_update: needs the model's query statistics"});
  }
  {
    const auto state = press.new_sequence_state();
    expect_error([&] { press.decoding_update(d.forward(1), 6, *state); },
                 {"a forward must reach its layers in order from 0, got layer 1"});
    LayerInputs two = d.forward(0);
    two.keys = at::cat({two.keys, two.keys});
    expect_error([&] { press.decoding_update(two, 6, *state); }, {"decodes one sequence per state (batch 1)"});
    LayerInputs layers = d.forward(0);
    layers.num_layers = 2;
    expect_error([&] { press.decoding_update(layers, 6, *state); },
                 {"the statistics cover 3 layers, the model has num_layers 2"});
  }
  {
    // A layer holding other tokens than the record (another press compressed it).
    const auto state = press.new_sequence_state();
    press.decoding_update(d.forward(0), 6, *state);
    LayerInputs shorter = d.forward(1);
    shorter.keys = shorter.keys.narrow(2, 0, 5);
    shorter.values = shorter.values.narrow(2, 0, 5);
    expect_error([&] { press.decoding_update(shorter, 6, *state); },
                 {"layer 1 holds 5 tokens in 2 KV heads, the press's record of the sequence 6 in 2"});
  }
  TriAttentionPress::Statistics wrong = stats;
  wrong.q_abs_mean = wrong.q_abs_mean.narrow(2, 0, 2);
  expect_error([&] { TriAttentionPress(p, wrong); }, {"TriAttentionPress: q_abs_mean must be a float tensor of"});
  p.score_aggregation = "median";
  expect_error([&] { TriAttentionPress{p}; }, {"score_aggregation"});
  const kvpress::testing::TempDir dir;
  expect_error([&] { TriAttentionPress::load_statistics(dir.path + "/none.safetensors"); }, {"none.safetensors"});
}

// On the tiny model with statistics calibrated on its own prefill: every layer holds the same number
// of tokens, bounded by budget + divide_length, and the paged runner generates what the dense one does.
TEST(TriAttentionPress, GeneratesOnTheDenseAndThePagedRunnerAlike) {
  const kvpress::llama::LlamaModel& model = kvpress::testing::tiny_model();
  std::vector<int64_t> calibration{1};
  for (int64_t i = 0; i < 95; ++i) calibration.push_back(200 + (i * 53) % 300);
  const kvpress::llama::CapturedPrefill captured =
      model.capture_prefill(at::tensor(calibration, at::kLong).unsqueeze(0));
  const kvpress::testing::TempDir dir;
  const std::string stats = dir.path + "/triattention.safetensors";
  TriAttentionPress::save_statistics(stats, TriAttentionPress::calibrate(captured.layers));
  const auto press =
      kvpress::make_press("TriAttentionPress", 0.0, {{"budget", "36"}, {"divide_length", "8"}, {"stats_file", stats}});
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t n : {20, 31}) {
    std::vector<int64_t> prompt{1};
    for (int64_t i = 1; i < n; ++i) prompt.push_back(300 + (i * 37 + n) % 200);
    prompts.push_back(prompt);
  }
  kvpress::llama::PagedGenerationOptions paged;
  paged.press = press.get();
  paged.max_new_tokens = 40;
  paged.stop_at_eos = false;
  const kvpress::llama::PagedGenerations run = kvpress::llama::generate_paged(model, prompts, paged);
  for (size_t i = 0; i < prompts.size(); ++i) {
    kvpress::llama::GenerationOptions dense;
    dense.press = press.get();
    dense.max_new_tokens = 40;
    dense.stop_at_eos = false;
    const kvpress::llama::Generation g = kvpress::llama::generate_greedy(model, prompts[i], {}, dense);
    const int64_t prompt = static_cast<int64_t>(prompts[i].size());
    // Positions 0..prompt+38 were forwarded: compressions at 44 tokens back to 36, every 8 tokens.
    const int64_t forwarded = prompt + 39, expected = 36 + (forwarded - 36) % 8;
    EXPECT_EQ(g.final_cache_lengths, std::vector<int64_t>(static_cast<size_t>(model.config().num_layers), expected))
        << "prompt " << i;
    EXPECT_EQ(run.generations[i].tokens, g.tokens) << "prompt " << i;
    EXPECT_EQ(run.generations[i].final_cache_lengths, g.final_cache_lengths) << "prompt " << i;
  }
}

}  // namespace
