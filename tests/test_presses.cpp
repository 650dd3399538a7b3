// Behaviour of each press that a user relies on, independent of the kvpress fixtures.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvpress/kvpress.h"
#include "random_inputs.h"
#include "runnable_press.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::randn;
using testing::random_layer;

bool strictly_ascending(const at::Tensor& idx) {
  return idx.size(-1) < 2 ||
         (idx.narrow(-1, 1, idx.size(-1) - 1) > idx.narrow(-1, 0, idx.size(-1) - 1)).all().item<bool>();
}

TEST(EveryPress, KeepsNKeptAscendingTokensMatchingTheGatheredCache) {
  const LayerInputs in = random_layer(300, 1);
  for (const PressInfo& info : list_presses()) {
    if (info.kind == PressKind::kDecoding) continue;    // no prefill ratio: tests/test_decoding.cpp
    if (info.kind == PressKind::kSecondPass) continue;  // KVComposePress: tests/test_kvcompose.cpp
    if (info.name == "CTRPress") continue;              // adaptive budget, rescued values: tests/test_ctr.cpp
    if (info.name == "DMSPress") continue;              // no ratio, a threshold: tests/test_dms.cpp
    if (info.kind == PressKind::kChannel) continue;     // keeps every token: ThinKPress tests below
    if (info.kind == PressKind::kLayer) continue;       // no ratio: SimLayerKVPress tests below
    for (double ratio : {0.25, 0.5, 0.75}) {
      SCOPED_TRACE(info.name + " ratio " + std::to_string(ratio));
      // Presses with a random draw get a seed, so that the same call gives the same answer.
      const auto press = make_press(info.name, ratio, testing::runnable_params(info, in));
      if (const auto* lukv = dynamic_cast<const LUKVPress*>(press.get())) {  // its curve's head budgets
        EXPECT_TRUE(
            at::equal(press->compress_ragged(in).keep_mask.sum(-1)[0], lukv->head_budgets(in.layer_idx, 2, 300)));
        continue;
      }
      if (press->head_ragged()) {  // heads keep different counts; the layer keeps Hkv * n_kept
        EXPECT_EQ(press->compress_ragged(in).keep_mask.sum().item<int64_t>(), 2 * ops::n_kept(300, ratio));
        continue;
      }
      const KV kv = press->compress(in);
      // ChunkKVPress keeps whole chunks of 20: int(15 * (1 - ratio)) of the 15. PyramidKVPress: its
      // layer budget.
      const int64_t n = info.name == "ChunkKVPress" ? 20 * static_cast<int64_t>(15 * (1 - ratio))
                        : info.name == "PyramidKVPress"
                            ? dynamic_cast<const PyramidKVPress&>(*press).layer_budget(300, 0, 1)
                            : ops::n_kept(300, ratio);
      ASSERT_EQ(kv.kept_indices.sizes(), (at::IntArrayRef{1, 2, n}));
      ASSERT_EQ(kv.keys.sizes(), (at::IntArrayRef{1, 2, n, 16}));
      EXPECT_TRUE(strictly_ascending(kv.kept_indices));
      const KV expected = ops::gather_kv(in.keys, in.values, kv.kept_indices);
      // KeyRerotationPress re-rotates the kept keys (tests/test_wrappers.cpp).
      if (!press->rerotates_keys()) EXPECT_TRUE(at::equal(kv.keys, expected.keys));
      // MergingPress blends the evicted values into the kept ones (tests/test_wrappers.cpp).
      if (info.name != "MergingPress") EXPECT_TRUE(at::equal(kv.values, expected.values));
      // Stateless: the same call gives the same answer.
      EXPECT_TRUE(at::equal(press->compress(in).kept_indices, kv.kept_indices));
    }
  }
}

TEST(EveryPress, RatioZeroReturnsTheCacheUntouched) {
  const LayerInputs in = random_layer(100, 2);
  for (const PressInfo& info : list_presses()) {
    SCOPED_TRACE(info.name);
    if (info.kind == PressKind::kSecondPass) continue;  // KVComposePress: tests/test_kvcompose.cpp
    if (info.name == "DMSPress") continue;              // no ratio: its threshold decides (tests/test_dms.cpp)
    if (make_press(info.name, 0.0)->head_ragged()) {
      const RaggedKV kv = make_press(info.name, 0.0)->compress_ragged(in);
      EXPECT_TRUE(kv.keep_mask.all().item<bool>());
      EXPECT_TRUE(at::equal(kv.at(0, 1).kept_indices, at::arange(100)));
      continue;
    }
    const KV kv = make_press(info.name, 0.0)->compress(in);
    EXPECT_TRUE(kv.keys.is_same(in.keys));
    EXPECT_TRUE(at::equal(kv.kept_indices[0][1], at::arange(100)));
  }
}

TEST(KnormPress, KeepsTheSmallestNormKeys) {
  LayerInputs in = random_layer(20, 3);
  const KV kv = KnormPress(0.5).compress(in);
  const at::Tensor norms = in.keys.norm(2, -1);
  for (int64_t h = 0; h < 2; ++h) {
    const at::Tensor kept_norms = norms[0][h].index_select(0, kv.kept_indices[0][h]);
    const at::Tensor kept_mask = at::zeros({20}, at::kBool).index_fill_(0, kv.kept_indices[0][h], true);
    const at::Tensor dropped_norms = norms[0][h].masked_select(kept_mask.logical_not());
    EXPECT_LT(kept_norms.max().item<float>(), dropped_norms.min().item<float>());
  }
}

TEST(StreamingLLMPress, KeepsSinksAndTheMostRecentTokens) {
  const LayerInputs in = random_layer(20, 4);
  const KV kv = StreamingLLMPress(0.5, 4).compress(in);
  at::Tensor expected = at::cat({at::arange(4), at::arange(14, 20)});
  EXPECT_TRUE(at::equal(kv.kept_indices[0][0], expected));
  EXPECT_TRUE(at::equal(kv.kept_indices[0][1], expected));
}

TEST(SnapKVPress, AlwaysKeepsTheObservationWindow) {
  const LayerInputs in = random_layer(200, 5);
  const KV kv = SnapKVPress(0.75, 16, 5).compress(in);
  for (int64_t h = 0; h < 2; ++h)
    EXPECT_TRUE(at::equal(kv.kept_indices[0][h].narrow(0, kv.kept_indices.size(2) - 16, 16), at::arange(184, 200)));
}

TEST(SnapKVPress, AttentionsAndQueriesGiveTheSameScores) {
  // random_layer's attentions are softmax(q k^T) without 1/sqrt(D); rebuild them with it.
  LayerInputs in = random_layer(120, 6);
  const at::Tensor logits = at::matmul(in.queries, in.keys.repeat_interleave(4, 1).transpose(2, 3)) / 4.0;
  in.attentions = at::softmax(logits.masked_fill(at::ones({120, 120}, at::kBool).triu(1), -INFINITY), -1);
  LayerInputs from_queries = in;
  from_queries.attentions = at::Tensor();
  const SnapKVPress press(0.5, 32, 5);
  EXPECT_TRUE(at::allclose(press.score(in), press.score(from_queries), 1e-5, 1e-7));
}

TEST(TOVAPress, AlwaysKeepsTheLastTokenAndSharesSelectionAcrossHeads) {
  const LayerInputs in = random_layer(50, 7);
  const KV kv = TOVAPress(0.8).compress(in);
  EXPECT_EQ(kv.kept_indices[0][0][-1].item<int64_t>(), 49);
  EXPECT_TRUE(at::equal(kv.kept_indices[0][0], kv.kept_indices[0][1]));
}

TEST(RandomPress, SeedMakesSelectionReproducible) {
  const LayerInputs in = random_layer(64, 8);
  EXPECT_TRUE(at::equal(RandomPress(0.5, 3).compress(in).kept_indices, RandomPress(0.5, 3).compress(in).kept_indices));
  EXPECT_FALSE(at::equal(RandomPress(0.5, 3).compress(in).kept_indices, RandomPress(0.5, 4).compress(in).kept_indices));
}

TEST(LagKVPress, KeepsSinksAndTheTailPartition) {
  const LayerInputs in = random_layer(4 + 128 * 3 + 10, 9);
  const KV kv = LagKVPress(0.5).compress(in);
  const at::Tensor kept = kv.kept_indices[0][0];
  EXPECT_TRUE(at::equal(kept.narrow(0, 0, 4), at::arange(4)));
  EXPECT_TRUE(at::equal(kept.narrow(0, kept.size(0) - 138, 138), at::arange(4 + 256, 4 + 384 + 10)));
}

// ThinKPress against its formula, written out in double: channel score = mean over the last w
// queries of q_c² (group-averaged) times mean over the sequence of k_c²; the int(D · ratio)
// lowest channels are zeroed in every key; every token and every value kept.
TEST(ThinKPress, ZeroesTheLowestScoringKeyChannels) {
  const LayerInputs in = random_layer(40, 21, 8, 2, 16);
  for (int64_t window : {5, 32, 64}) {  // 64 > S: every query, as kvpress's slice
    const auto press = make_press("ThinKPress", 0.5, {{"window_size", std::to_string(window)}});
    const auto& think = dynamic_cast<const ThinKPress&>(*press);
    EXPECT_DOUBLE_EQ(press->compression_ratio(), 0.25);  // kvpress: half the channel ratio
    const int64_t w = std::min<int64_t>(window, 40);
    const at::Tensor q = in.queries.narrow(2, 40 - w, w).to(at::kDouble);
    const at::Tensor k = in.keys.to(at::kDouble);
    const at::Tensor expected = (q * q).mean(2).view({1, 2, 4, 16}).mean(2) * (k * k).mean(2);  // [1, 2, 16]
    EXPECT_TRUE(at::allclose(think.channel_scores(in).to(at::kDouble), expected, 1e-6, 1e-9)) << window;
    const at::Tensor pruned = think.pruned_channels(in);
    ASSERT_EQ(pruned.sizes(), (at::IntArrayRef{1, 2, 8}));
    for (int64_t h = 0; h < 2; ++h) {
      const at::Tensor lowest = std::get<0>(std::get<1>(expected[0][h].sort()).narrow(0, 0, 8).sort());
      EXPECT_TRUE(at::equal(pruned[0][h], lowest)) << window << " head " << h;
    }
    const KV kv = press->compress(in);
    const at::Tensor zeroed = at::zeros({1, 2, 16}, at::kBool).scatter_(2, pruned, true).unsqueeze(2);
    EXPECT_TRUE(at::equal(kv.keys, in.keys.masked_fill(zeroed, 0)));
    EXPECT_TRUE(at::equal(kv.values, in.values));
    EXPECT_TRUE(at::equal(kv.kept_indices, at::arange(40, at::kLong).expand({1, 2, 40})));
  }
  // Ratio 0 returns the cache untouched; a ratio below 1/D prunes no channel.
  EXPECT_TRUE(make_press("ThinKPress", 0.0)->compress(in).keys.is_same(in.keys));
  EXPECT_TRUE(at::equal(make_press("ThinKPress", 0.05)->compress(in).keys, in.keys));
  // With a token press after it (later presses of ComposedPress see keys and values only).
  const auto composed = make_press("ComposedPress", 0.5, {{"presses", "ThinKPress,KnormPress"}});
  const KV kv = composed->compress(in);
  EXPECT_EQ(kv.kept_indices.size(2), 20);
  EXPECT_EQ((kv.keys == 0).all(2).sum().item<int64_t>(), 2 * 8);  // 8 zeroed channels per head
  expect_error([] { ThinKPress(1.0); }, {"ThinKPress: key_channel_compression_ratio must be in [0, 1), got 1"});
  expect_error([] { ThinKPress(0.5, 0); }, {"ThinKPress: window_size must be"});
}

TEST(SimLayerKVPress, KeepsALazyLayersFirstAndLastTokens) {
  const int64_t seq = 60, initial = 3, recent = 10, last = 2;
  const LayerInputs with_attentions = random_layer(seq, 23, 8, 2, 16);
  LayerInputs in = with_attentions;
  in.attentions = at::Tensor();                    // the queries' attention, recomputed
  auto ends_share = [&](const at::Tensor& attn) {  // [S - last]
    return (attn.narrow(0, 0, initial).sum() + attn.narrow(0, seq - last - recent, recent).sum()).item<double>();
  };
  // The share of the last `last` queries' attention (mean over heads and those queries) on the
  // first `initial` and the `recent` keys just before them, computed here in double.
  const at::Tensor q = in.queries.narrow(2, seq - last, last).to(at::kDouble);              // [1, 8, 2, 16]
  const at::Tensor k = in.keys.to(at::kDouble).repeat_interleave(4, 1);                     // [1, 8, S, 16]
  at::Tensor logits = at::matmul(q, k.transpose(2, 3)) / 4.0;                               // [1, 8, 2, S]
  logits.select(2, 0).select(-1, seq - 1).fill_(-std::numeric_limits<double>::infinity());  // causal
  const double share = ends_share(at::softmax(logits, -1).narrow(-1, 0, seq - last).mean({0, 1, 2}));
  auto press = [&](double threshold) { return SimLayerKVPress(threshold, last, recent, initial); };
  ASSERT_TRUE(press(0.5).lazy_score(in).has_value());
  EXPECT_NEAR(*press(0.5).lazy_score(in), share, 1e-6);
  // Given attentions: their last rows.
  const at::Tensor given = with_attentions.attentions.narrow(2, seq - last, last).narrow(3, 0, seq - last);
  EXPECT_NEAR(*press(0.5).lazy_score(with_attentions), ends_share(given.to(at::kDouble).mean({0, 1, 2})), 1e-6);
  // Above the threshold: the first 3 and the last recent - last = 8 tokens; below it: every token.
  const KV lazy = press(share - 1e-3).compress(in);
  const at::Tensor ends = at::cat({at::arange(initial), at::arange(seq - (recent - last), seq)});
  EXPECT_TRUE(at::equal(lazy.kept_indices, ends.expand({1, 2, ends.size(0)})));
  EXPECT_TRUE(at::equal(lazy.values, ops::gather_kv(in.keys, in.values, lazy.kept_indices).values));
  EXPECT_TRUE(press(share + 1e-3).compress(in).keys.is_same(in.keys));
  // Threshold 1 (the default) or too few tokens: the layer is not judged.
  EXPECT_FALSE(press(1.0).lazy_score(in).has_value());
  EXPECT_FALSE(SimLayerKVPress(0.0, last, seq - initial - last, initial).lazy_score(in).has_value());
  EXPECT_TRUE(SimLayerKVPress(0.0, last, seq - initial - last - 1, initial).is_lazy(in));
  // No ratio: the registry takes 0 only, and a ComposedPress gives it 0.
  expect_error([] { make_press("SimLayerKVPress", 0.5); },
               {"SimLayerKVPress: compression_ratio must be 0 (each layer keeps", "got 0.5"});
  const auto composed = make_press(
      "ComposedPress", 0.5,
      {{"presses", "SimLayerKVPress,KnormPress"}, {"presses.0.lazy_threshold", "0"}, {"presses.0.n_recent", "20"}});
  EXPECT_EQ(composed->compress(in).kept_indices.size(2), ops::n_kept(4 + 19, 0.5));  // default n_initial, n_last
  expect_error([] { SimLayerKVPress(1.5); }, {"SimLayerKVPress: lazy_threshold must be in [0, 1], got 1.5"});
  expect_error([] { SimLayerKVPress(0.5, 0); }, {"SimLayerKVPress: n_last must be > 0, got 0"});
  expect_error([] { SimLayerKVPress(0.5, 4, 4); }, {"SimLayerKVPress: n_recent must be > n_last = 4", "got 4"});
  expect_error([] { SimLayerKVPress(0.5, 1, 8, -1); }, {"SimLayerKVPress: n_initial must be >= 0, got -1"});
}

TEST(QFilterPress, ScoresKeysAgainstTheLayersFilterFromAFile) {
  LayerInputs in = random_layer(50, 31, 8, 2, 16);
  in.layer_idx = 1;
  in.num_layers = 3;
  const std::string path = testing::random_artifact("q_filters", {3, 8, 2, 16});
  const at::Tensor filters = QFilterPress::load_filters(path);  // [3, 2, 16]
  const auto press = make_press("QFilterPress", 0.5, {{"q_filters", path}});
  // score = -(filter of layer 1, head h) . k, computed here in double.
  const at::Tensor expected =
      -(in.keys.to(at::kDouble) * filters[1].to(at::kDouble).view({1, 2, 1, 16})).sum(-1);  // [1, 2, 50]
  const at::Tensor scores = dynamic_cast<const QFilterPress&>(*press).score(in);
  EXPECT_TRUE(at::allclose(scores.to(at::kDouble), expected, 1e-5, 1e-6));
  EXPECT_TRUE(at::equal(press->compress(in).kept_indices, ops::topk_indices(scores, 25)));
  // Without filters, with a layer or shape the filters do not have, or a file without them: errors.
  expect_error([&] { make_press("QFilterPress", 0.5)->compress(in); },
               {"QFilterPress.score: no Q-filters: give q_filters=PATH", "scripts/make_artifact.py"});
  LayerInputs beyond = in;
  beyond.layer_idx = 3;
  beyond.num_layers = 4;
  expect_error([&] { press->compress(beyond); }, {"QFilterPress.score: layer_idx must be in [0, 3)", "got 3"});
  expect_error([&] { QFilterPress(0.5, filters.narrow(2, 0, 8)).compress(in); },
               {"QFilterPress.score: q_filters must be [3, 2, 16] to match keys", "got [3, 2, 8]"});
  expect_error([] { QFilterPress(0.5, at::zeros({2, 16})); }, {"QFilterPress: q_filters must be [num_layers"});
  const std::string other = testing::random_artifact("q_filters", {1, 1, 1, 4}) + ".renamed";
  io::save_safetensors(other, {{"filters", at::zeros({1, 1, 4})}});
  expect_error([&] { QFilterPress::load_filters(other); }, {"QFilterPress: ", other, "holds no tensor 'q_filters'"});
  std::filesystem::remove(other);
  expect_error(
      [] {
        make_press("QFilterPress", 0.5, {{"q_filters", "/nonexistent/f.safetensors"}});
      },
      {"load_safetensors: /nonexistent/f.safetensors"});
  EXPECT_TRUE(needs_file(*find_press("QFilterPress")));
  EXPECT_FALSE(needs_file(*find_press("KnormPress")));
}

TEST(ExpectedAttentionStatsPress, GivenThePromptsOwnStatisticsScoresAsExpectedAttentionPress) {
  LayerInputs in = random_layer(80, 41, 8, 2, 16);
  in.layer_idx = 1;
  in.num_layers = 2;
  // The pre-RoPE queries (RoPE undone) of positions n_sink.., their mean and biased covariance:
  // what ExpectedAttentionPress measures on the prompt.
  const int64_t n_sink = ExpectedAttentionPress::kDefaultNSink, d = 16;
  const at::Tensor rotated = at::cat({in.queries.narrow(-1, d / 2, d / 2), -in.queries.narrow(-1, 0, d / 2)}, -1);
  const at::Tensor pre = (in.queries * in.cos + rotated * in.sin).narrow(2, n_sink, 80 - n_sink)[0].to(at::kDouble);
  const at::Tensor mean = pre.mean(1);                                                  // [8, 16]
  const at::Tensor centred = pre - mean.unsqueeze(1);                                   // [8, n, 16]
  const at::Tensor cov = at::matmul(centred.transpose(1, 2), centred) / (80 - n_sink);  // [8, 16, 16]
  // Layer 1 of the file holds them; layer 0 something else.
  const ExpectedAttentionStatsPress::Statistics stats{at::stack({at::zeros_like(mean), mean}).to(at::kFloat),
                                                      at::stack({at::zeros_like(cov), cov}).to(at::kFloat)};
  const ExpectedAttentionStatsPress press(0.5, stats);
  EXPECT_TRUE(at::allclose(press.score(in), ExpectedAttentionPress(0.5).score(in), 1e-4, 1e-6));
  LayerInputs keys_only;  // no queries needed: keys, values, layer_idx and RoPE frequencies
  keys_only.keys = in.keys;
  keys_only.values = in.values;
  keys_only.cos = in.cos;
  keys_only.sin = in.sin;
  keys_only.layer_idx = 1;
  keys_only.num_layers = 2;
  EXPECT_TRUE(at::equal(press.score(keys_only), press.score(in)));
  // From a folder as kvpress saves it, through the registry.
  const std::string folder = testing::random_artifact("stats_folder", {2, 8, 2, 16});
  io::save_safetensors(folder + "/model.safetensors",
                       {{"query_mean", stats.query_mean}, {"query_cov", stats.query_cov}});
  const auto built = make_press("ExpectedAttentionStatsPress", 0.5, {{"stats_folder", folder}});
  EXPECT_TRUE(at::equal(dynamic_cast<const ExpectedAttentionStatsPress&>(*built).score(in), press.score(in)));
  // Errors: no statistics (naming what kvpress would download), a layer or head dim they lack,
  // mismatched shapes, a folder without them.
  expect_error([&] { make_press("ExpectedAttentionStatsPress", 0.5)->compress(in); },
               {"ExpectedAttentionStatsPress.score: no query statistics: give stats_folder=DIR",
                "exp_att_stats_<model>_kmfoda/booksum_100_1000_4"});
  LayerInputs beyond = in;
  beyond.layer_idx = 2;
  beyond.num_layers = 3;
  expect_error([&] { press.score(beyond); }, {"layer_idx must be in [0, 2)", "got 2"});
  expect_error(
      [&] {
        ExpectedAttentionStatsPress(0.5, {stats.query_mean, stats.query_cov.narrow(3, 0, 8)});
      },
      {"ExpectedAttentionStatsPress: query_cov must be a float [2, 8, 16, 16] tensor", "got [2, 8, 16, 8]"});
  io::save_safetensors(folder + "/model.safetensors", {{"query_mean", stats.query_mean}});
  expect_error([&] { ExpectedAttentionStatsPress::load_statistics(folder); },
               {"ExpectedAttentionStatsPress: ", folder, "holds no tensor 'query_cov'"});
  expect_error(
      [] {
        make_press("ExpectedAttentionStatsPress", 0.5, {{"num_samples", "0"}});
      },
      {"ExpectedAttentionStatsPress: num_samples must be > 0, got 0"});
}

TEST(KVzapPress, ScoresTokensWithTheLayersSurrogateOfTheirHiddenStates) {
  LayerInputs in = random_layer(40, 51, 8, 2, 16);  // hidden_states [1, 40, 32]
  in.layer_idx = 1;
  in.num_layers = 2;
  const std::string folder = testing::random_artifact("kvzap_model", {2, 8, 2, 16, 32});
  const KVzapPress::Surrogate s = KVzapPress::load_surrogate(folder);  // hidden 32 -> 8 -> 2 per layer
  ASSERT_EQ(s.w1.sizes(), (at::IntArrayRef{2, 8, 32}));
  const auto press = make_press("KVzapPress", 0.5, {{"kvzap_model", folder}});
  // Layer 1's MLP with the exact GELU x·Φ(x), in double.
  const at::Tensor x = in.hidden_states[0].to(at::kDouble);                                   // [40, 32]
  const at::Tensor h = at::matmul(x, s.w1[1].to(at::kDouble).t()) + s.b1[1].to(at::kDouble);  // [40, 8]
  const at::Tensor gelu = h * 0.5 * (1 + at::erf(h / std::sqrt(2.0)));
  const at::Tensor expected = (at::matmul(gelu, s.w2[1].to(at::kDouble).t()) + s.b2[1].to(at::kDouble)).t();  // [2, 40]
  const at::Tensor scores = dynamic_cast<const KVzapPress&>(*press).score(in);
  EXPECT_TRUE(at::allclose(scores[0].to(at::kDouble), expected, 1e-5, 1e-5));
  // A linear surrogate: hidden -> Hkv.
  const KVzapPress linear(0.5, KVzapPress::ModelType::kLinear, {s.w1.narrow(1, 0, 2), s.b1.narrow(1, 0, 2), {}, {}});
  const at::Tensor lin =
      (at::matmul(x, s.w1[1].narrow(0, 0, 2).to(at::kDouble).t()) + s.b1[1].narrow(0, 0, 2).to(at::kDouble)).t();
  EXPECT_TRUE(at::allclose(linear.score(in)[0].to(at::kDouble), lin, 1e-5, 1e-5));
  // Errors: none given, another model_type than the folder's, mismatched hidden size or heads.
  expect_error([&] { make_press("KVzapPress", 0.5)->compress(in); },
               {"KVzapPress.score: no surrogate: give kvzap_model=DIR", "nvidia/KVzap-mlp-<model>"});
  expect_error(
      [&] {
        make_press("KVzapPress", 0.5, {{"kvzap_model", folder}, {"model_type", "linear"}});
      },
      {"KVzapPress: model_type is linear but the surrogate is an mlp"});
  LayerInputs wider = in;
  wider.hidden_states = at::randn({1, 40, 48});
  expect_error([&] { press->compress(wider); }, {"the surrogate takes hidden size 32, hidden_states have 48"});
  LayerInputs one_head = in;
  one_head.keys = in.keys.narrow(1, 0, 1);
  one_head.values = in.values.narrow(1, 0, 1);
  expect_error([&] { press->compress(one_head); }, {"the surrogate predicts 2 heads, keys have 1"});
}

TEST(Registry, KindsMatchTheBuiltPresses) {
  const std::set<std::string> wrappers{"KeyRerotationPress",
                                       "ChunkKVPress",
                                       "EntropyGatedChunkKVPress",
                                       "ChunkPress",
                                       "BlockPress",
                                       "ComposedPress",
                                       "AdaKVPress",
                                       "CriticalKVPress",
                                       "CriticalAdaKVPress",
                                       "PerLayerCompressionPress",
                                       "LUKVPress",
                                       "MergingPress",
                                       "DMSPress"};
  const std::set<std::string> decoding{"DecodingPress",        "CompressionRatioDecodingPress",
                                       "PrefillDecodingPress", "CAMPress",
                                       "RKVDecodingPress",     "TriAttentionPress"};
  for (const PressInfo& info : list_presses()) {
    const PressKind expected = wrappers.count(info.name)   ? PressKind::kWrapper
                               : decoding.count(info.name) ? PressKind::kDecoding
                               : info.name == "KVComposePress" || info.name == "KVzipPress" ||
                                       info.name == "FastKVzipPress" || info.name == "KVgradPress" ||
                                       info.name == "RestoreKVPress" || info.name == "LayerDefensiveKVPress"
                                   ? PressKind::kSecondPass
                               : info.name == "ThinKPress" ? PressKind::kChannel
                               : info.name == "SimLayerKVPress" || info.name == "DuoAttentionPress" ? PressKind::kLayer
                               : info.name == "FinchPress" ? PressKind::kQueryAware
                                                           : PressKind::kScorer;
    EXPECT_EQ(info.kind, expected) << info.name;
    // Scorers are ScorerPresses (CriticalKVPress is one too, around its inner press).
    const auto press = make_press(info.name, 0.0);
    if (info.kind == PressKind::kScorer) EXPECT_NE(dynamic_cast<const ScorerPress*>(press.get()), nullptr) << info.name;
    // The press object says what its registry kind says about a second pass.
    EXPECT_EQ(press->needs_second_pass(), info.kind == PressKind::kSecondPass) << info.name;
  }
}

TEST(Registry, ListsEveryParameterWithItsTypedDefault) {
  const PressInfo* snap = find_press("SnapKVPress");
  ASSERT_NE(snap, nullptr);
  ASSERT_EQ(snap->params.size(), 2u);
  EXPECT_EQ(snap->params[0].name, "window_size");
  EXPECT_EQ(snap->params[0].type, "int");
  EXPECT_EQ(snap->params[0].default_value, std::to_string(SnapKVPress::kDefaultWindowSize));
  const PressInfo* ada = find_press("AdaKVPress");
  ASSERT_NE(ada, nullptr);
  EXPECT_EQ(ada->params[0].name, "press");
  EXPECT_EQ(ada->params[0].default_value, "KnormPress");
  EXPECT_EQ(ada->params[1].default_value, "0.2");
  const PressInfo* compactor = find_press("CompactorPress");
  ASSERT_NE(compactor, nullptr);
  EXPECT_EQ(compactor->params.back().type, "str");
  EXPECT_EQ(compactor->params.back().default_value, "per_head");
  EXPECT_EQ(find_press("NoSuchPress"), nullptr);
  // Every input a press declares is a LayerInputs field.
  std::set<std::string> fields;
  for (const LayerInputField& f : layer_input_fields()) fields.insert(f.name);
  for (const PressInfo& info : list_presses()) {
    std::vector<std::string> names = info.inputs.required;
    names.insert(names.end(), info.inputs.optional.begin(), info.inputs.optional.end());
    for (const InputSet& set : info.inputs.alternatives)
      names.insert(names.end(), set.fields.begin(), set.fields.end());
    for (const std::string& name : names) EXPECT_TRUE(fields.count(name)) << info.name << ": " << name;
  }
  EXPECT_EQ(describe_inputs(*snap), "attentions | queries | hidden_states+q_proj+cos+sin");
  EXPECT_EQ(describe_inputs(*find_press("KnormPress")), "keys, values");
}

// Regression, found by AddressSanitizer (stack-use-after-scope): list_presses() ran every factory
// on parameters held by reference to a temporary map already destroyed. Alone in its process (ctest
// runs each test in its own) this is the listing's first build, which scripts/test_sanitized.sh
// checks; every declared default, given back as text, must rebuild the press.
TEST(Registry, DeclaredDefaultsRebuildEveryPress) {
  for (const PressInfo& info : list_presses()) {
    SCOPED_TRACE(info.name);
    std::map<std::string, std::string> defaults;
    for (const PressParam& p : info.params) defaults[p.name] = p.default_value;
    EXPECT_EQ(make_press(info.name, 0.0, defaults)->name(), info.name);
  }
}

TEST(Registry, ParsesNumbersInOnePlace) {
  EXPECT_EQ(parse_int("42"), 42);
  EXPECT_EQ(parse_int("+7"), 7);
  EXPECT_EQ(parse_int("-3"), -3);
  EXPECT_FALSE(parse_int("12x"));
  EXPECT_FALSE(parse_int(""));
  EXPECT_FALSE(parse_int(" 1"));
  EXPECT_FALSE(parse_int("99999999999999999999"));
  EXPECT_EQ(parse_double("0.25"), 0.25);
  EXPECT_EQ(parse_double("1e-4"), 1e-4);
  EXPECT_FALSE(parse_double("inf"));
  EXPECT_FALSE(parse_double("nan"));
  EXPECT_FALSE(parse_double("1e999"));
  EXPECT_FALSE(parse_double("0.5 "));
  expect_error(
      [] {
        make_press("ComposedPress", 0.5, {{"presses", "KnormPress"}, {"presses.0.compression_ratio", "x"}});
      },
      {"ComposedPress: parameter presses.0.compression_ratio must be a number, got 'x'"});
}

TEST(Registry, BuildsEveryPressWithItsKvpressName) {
  // As many as the press sources declare (counted by tests/CMakeLists.txt): none lost, none twice.
  ASSERT_EQ(list_presses().size(), static_cast<size_t>(KVPRESS_REGISTERED_PRESSES));
  for (const PressInfo& info : list_presses())  // DecodingPress and SimLayerKVPress take no ratio
    EXPECT_EQ(make_press(info.name, ratio_for(info, 0.5))->name(), info.name);
  const auto snap = make_press("SnapKVPress", 0.3, {{"window_size", "16"}, {"kernel_size", "3"}});
  EXPECT_EQ(dynamic_cast<SnapKVPress&>(*snap).window_size(), 16);
  EXPECT_DOUBLE_EQ(snap->compression_ratio(), 0.3);
  const auto lag = make_press("LagKVPress", 0.5, {{"cross_scoring", "true"}, {"lag_size", "32"}});
  EXPECT_TRUE(dynamic_cast<LagKVPress&>(*lag).cross_scoring());
  // CURPress's leverage_type is parsed from text: the registry's default is the press's.
  EXPECT_EQ(dynamic_cast<CURPress&>(*make_press("CURPress", 0.5)).leverage_type(), CURPress::kDefaultLeverageType);
  const auto cur = make_press("CURPress", 0.5, {{"leverage_type", "kv_avg"}, {"local_window_size", "7"}});
  EXPECT_EQ(dynamic_cast<CURPress&>(*cur).leverage_type(), CURPress::LeverageType::kKvAvg);
  EXPECT_EQ(dynamic_cast<CURPress&>(*cur).local_window_size(), 7);
}

}  // namespace
}  // namespace kvpress
