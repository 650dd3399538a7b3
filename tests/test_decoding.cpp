// Decoding presses (DecodingPress, CompressionRatioDecodingPress, PrefillDecodingPress) and the
// wrappers in the model loop.
//
// Decoding.*         unit tests: the target-ratio search, when step() compresses, the hidden-state
//                    buffer, the buffered queries, the registry syntax, bad input, and the Llama
//                    runner / generate_greedy / score_continuation with a decoding press.
// DecodingParity.*   against kvpress 0.5.5's pipeline on TinyStories-656K, from the fixtures of
//                    tests/reference/make_decoding_fixtures.py (<fixtures>/decoding; one ctest entry,
//                    parity.decoding_kvpress):
//   * decoding presses (order-free inner scorers: kvpress leaves a compressed cache in score order,
//     we in position order, which scorers reading slot neighbours see; docs/PRESS_NOTES.md): every
//     compression (the forward it happens in, the layer, the cache length, the kept original
//     positions) equals kvpress's, the logits of the question and of every generated token agree
//     within 1e-4, greedy generation gives kvpress's tokens, and the final cache lengths are equal;
//   * wrappers (KeyRerotation, ChunkKV, EntropyGatedChunkKV, Chunk, Block, Composed, Merging with an inner scorer) at
//   ratio 0.5:
//     the kept positions of every layer after prefill equal kvpress's pipeline and the logits of
//     the question and decode steps over the compressed cache agree within 1e-4;
//   * kvpress-cli eval's protocol with a decoding press (tokens fed one per forward): per-story
//     mean NLL within 1e-4 and the same argmax at every scored position.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "fixtures.h"
#include "kvpress/kvpress.h"
#include "kvpress/llama/llama.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::CompressionRatioDecodingPress;
using kvpress::DecodingPress;
using kvpress::DecodingState;
using kvpress::KV;
using kvpress::LayerInputs;
using kvpress::PrefillDecodingPress;
using kvpress::ScorerPress;
using kvpress::llama::ForwardOptions;
using kvpress::llama::KVCache;
using kvpress::llama::LlamaModel;
using kvpress::llama::PrefillOptions;
using kvpress::testing::expect_error;
using json = nlohmann::json;

constexpr double kLogitTol = 1e-4;

using kvpress::testing::tiny_model;

// The inner scorer `name` built by the registry at the ratio DecodingPress asks for.
kvpress::ScorerFactory scorer(const std::string& name, std::map<std::string, std::string> params = {}) {
  return [name, params](double ratio) {
    return std::dynamic_pointer_cast<const ScorerPress>(
        std::shared_ptr<const kvpress::BasePress>(kvpress::make_press(name, ratio, params)));
  };
}

// One decoding forward of a layer: a cache of s tokens [1, 2, s, 16], this forward's n hidden
// states [1, n, 32], q_proj [4 * 16, 32] and the RoPE rows of positions s - n .. s - 1.
LayerInputs forward_inputs(int64_t s, int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  LayerInputs in;
  in.keys = at::randn({1, 2, s, 16});
  in.values = at::randn({1, 2, s, 16});
  in.hidden_states = at::randn({1, n, 32});
  in.q_proj = at::randn({4 * 16, 32}) * 0.2;
  in.num_heads = 4;
  const at::Tensor inv_freq = 1.0 / at::pow(10000.0, at::arange(0, 16, 2).to(at::kFloat) / 16.0);
  const at::Tensor angles = at::arange(s - n, s).to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  in.cos = at::cat({angles, angles}, -1).cos();
  in.sin = at::cat({angles, angles}, -1).sin();
  in.inv_freq = inv_freq;
  in.num_layers = 1;
  return in;
}

// ---- unit tests ----------------------------------------------------------------------------------

TEST(Decoding, TargetRatioSearchGivesTheTargetAfterRounding) {
  EXPECT_EQ(DecodingPress::find_target_compression_ratio(10, 10), 0.0);
  EXPECT_EQ(DecodingPress::find_target_compression_ratio(5, 10), 0.0);
  for (int64_t k : {11, 37, 100, 113, 999, 4097})
    for (int64_t t : {1, 3, 10, 64, 2048}) {
      if (k <= t) continue;
      const double r = DecodingPress::find_target_compression_ratio(k, t);
      EXPECT_EQ(static_cast<int64_t>(static_cast<double>(k) * (1.0 - r)), t) << k << " -> " << t;
      EXPECT_EQ(kvpress::ops::n_kept(k, r), t) << k << " -> " << t;
    }
}

TEST(Decoding, StepCompressesEveryIntervalToTheTarget) {
  const DecodingPress press(scorer("KnormPress"), /*compression_interval=*/3, /*target_size=*/10,
                            /*hidden_states_buffer_size=*/2);
  DecodingState state;
  int64_t s = 12;  // the cache grows by one token per forward until a compression cuts it to 10
  std::vector<int64_t> compressed_at;
  for (int64_t forward = 1; forward <= 7; ++forward) {
    const LayerInputs in = forward_inputs(s, 1, forward);
    const std::optional<KV> kv = press.step(in, 100 + forward, state);
    if (kv) {
      compressed_at.push_back(forward);
      EXPECT_EQ(kv->keys.size(2), 10);
      // Knorm: the kept keys are the 10 smallest norms of the given cache.
      const at::Tensor expected = kvpress::ops::topk_indices(kvpress::KnormPress(0.5).score(in), 10);
      EXPECT_TRUE(at::equal(kv->kept_indices, expected));
      EXPECT_TRUE(state.hidden_states[0].empty());  // cleared at each compression
      EXPECT_EQ(state.steps[0], 0);
      s = 10;
    } else {
      EXPECT_LE(static_cast<int64_t>(state.hidden_states[0].size()), 2);  // the buffer keeps 2 forwards
    }
    ++s;
  }
  EXPECT_EQ(compressed_at, (std::vector<int64_t>{3, 6}));
}

TEST(Decoding, AForwardOfTargetSizeTokensCompressesAtOnce) {
  const DecodingPress press(scorer("StreamingLLMPress"), 100, /*target_size=*/8, 0);
  DecodingState state;
  const std::optional<KV> kv = press.step(forward_inputs(30, 8, 1), 30, state);
  ASSERT_TRUE(kv.has_value());
  EXPECT_TRUE(at::equal(kv->kept_indices[0][0], at::cat({at::arange(4), at::arange(26, 30)})));
  EXPECT_TRUE(state.hidden_states[0].empty());  // buffer size 0
  // A cache already within the budget is kept as it is (kvpress: ratio 0).
  DecodingState state2;
  const DecodingPress small(scorer("KnormPress"), 1, 50, 4);
  const std::optional<KV> same = small.step(forward_inputs(20, 1, 2), 20, state2);
  ASSERT_TRUE(same.has_value());
  EXPECT_TRUE(at::equal(same->kept_indices[0][1], at::arange(20)));
  EXPECT_TRUE(state2.hidden_states[0].empty());  // cleared at the compression, even a no-op one
}

TEST(Decoding, CompressionRatioTargetFollowsTheTokensSeen) {
  const CompressionRatioDecodingPress press(scorer("KnormPress"), 0.25, 4, 8);
  EXPECT_EQ(press.target_size(100), 75);
  EXPECT_EQ(press.target_size(1), 1);
  EXPECT_EQ(press.target_size(3), 2);
  EXPECT_EQ(press.compression_ratio(), 0.25);
  DecodingState state;
  const std::optional<KV> kv = press.step(forward_inputs(40, 40, 3), /*tokens_seen=*/40, state);  // 40 >= 30
  ASSERT_TRUE(kv.has_value());
  EXPECT_EQ(kv->keys.size(2), 30);
  // compress() alone takes tokens_seen = S.
  EXPECT_EQ(press.compress(forward_inputs(40, 4, 3)).keys.size(2), 30);
}

// The inner scorer sees the buffered hidden states as queries rotated with the latest forward's
// RoPE row (kvpress's window attention during decoding): SnapKV on those queries directly.
TEST(Decoding, InnerScorerGetsTheBufferedQueriesWithTheLatestRopeRow) {
  const LayerInputs first = forward_inputs(39, 1, 4);
  const LayerInputs second = forward_inputs(40, 1, 5);
  // Expected: queries of both buffered hidden states, each rotated with the second forward's row.
  const at::Tensor h = at::cat({first.hidden_states, second.hidden_states}, 1);  // [1, 2, 32]
  at::Tensor q = at::matmul(h, second.q_proj.t()).view({1, 2, 4, 16}).transpose(1, 2);
  const at::Tensor rot = at::cat({-q.narrow(-1, 8, 8), q.narrow(-1, 0, 8)}, -1);
  q = q * second.cos + rot * second.sin;
  LayerInputs direct;
  direct.keys = second.keys;
  direct.values = second.values;
  direct.queries = q;
  const DecodingPress press(scorer("SnapKVPress", {{"window_size", "2"}, {"kernel_size", "3"}}), 2, 20, 8);
  DecodingState state;
  ASSERT_FALSE(press.step(first, 39, state).has_value());
  const std::optional<KV> kv = press.step(second, 40, state);
  ASSERT_TRUE(kv.has_value());
  EXPECT_EQ(kv->keys.size(2), 20);
  const kvpress::SnapKVPress snap(0.5, 2, 3);  // int(40 * 0.5) = 20
  EXPECT_TRUE(at::equal(kv->kept_indices, snap.compress(direct).kept_indices));
  // A window of 3 with 2 buffered forwards: the inner press refuses (kvpress asserts), named.
  const DecodingPress wide(scorer("SnapKVPress", {{"window_size", "3"}}), 2, 20, 8);
  DecodingState s2;
  ASSERT_FALSE(wide.step(first, 39, s2).has_value());
  expect_error([&] { wide.step(second, 40, s2); },
               {"inner press SnapKVPress", "cannot score a decoding cache", "at least the last 3"});
}

TEST(Decoding, RegistryBuildsTheDecodingPresses) {
  const auto d = kvpress::make_press("DecodingPress", 0.0,
                                     {{"press", "SnapKVPress"},
                                      {"press.window_size", "8"},
                                      {"compression_interval", "16"},
                                      {"target_size", "128"},
                                      {"hidden_states_buffer_size", "32"}});
  const auto& dp = dynamic_cast<const DecodingPress&>(*d);
  EXPECT_EQ(dp.press()->name(), "SnapKVPress");
  EXPECT_EQ(dp.compression_interval(), 16);
  EXPECT_EQ(dp.target_size(1000), 128);
  EXPECT_EQ(dp.hidden_states_buffer_size(), 32);
  EXPECT_EQ(dp.press()->compression_ratio(), 0.0);
  const auto r = kvpress::make_press("CompressionRatioDecodingPress", 0.3, {{"press", "TOVAPress"}});
  EXPECT_EQ(dynamic_cast<const CompressionRatioDecodingPress&>(*r).target_compression_ratio(), 0.3);
  const auto both = kvpress::make_press("PrefillDecodingPress", 0.5,
                                        {{"prefilling_press", "SnapKVPress"},
                                         {"prefilling_press.window_size", "16"},
                                         {"decoding_press", "CompressionRatioDecodingPress"},
                                         {"decoding_press.press", "KeyDiffPress"},
                                         {"decoding_press.compression_ratio", "0.25"}});
  const auto& pd = dynamic_cast<const PrefillDecodingPress&>(*both);
  EXPECT_EQ(pd.prefilling_press()->compression_ratio(), 0.5);
  EXPECT_EQ(pd.decoding_press()->compression_ratio(), 0.25);
  EXPECT_EQ(pd.compression_ratio(), 0.5);
  // The lifecycle: which press runs at prefill, which one's updates while decoding.
  EXPECT_EQ(kvpress::prefill_press_of(both.get()), pd.prefilling_press().get());
  EXPECT_TRUE(both->decoding_role().compresses);
  EXPECT_EQ(both->decoding_role().scorer, pd.decoding_press()->press().get());
  EXPECT_NE(dynamic_cast<kvpress::DecodingState*>(both->new_sequence_state().get()), nullptr);
  EXPECT_EQ(kvpress::prefill_press_of(d.get()), nullptr);
  EXPECT_TRUE(d->decoding_role().compresses);
  EXPECT_EQ(d->decoding_role().scorer, dp.press().get());
  const auto knorm = kvpress::make_press("KnormPress", 0.5);
  EXPECT_EQ(kvpress::prefill_press_of(knorm.get()), knorm.get());
  EXPECT_FALSE(knorm->decoding_role().compresses);
  EXPECT_EQ(knorm->new_sequence_state(), nullptr);
  // kvpress's defaults: no parts; the cache is kept whole at prefill.
  const auto none = kvpress::make_press("PrefillDecodingPress", 0.5);
  const LayerInputs in = forward_inputs(30, 30, 6);
  EXPECT_EQ(none->compress(in).keys.size(2), 30);
  EXPECT_FALSE(none->decoding_role().compresses);
  EXPECT_EQ(none->new_sequence_state(), nullptr);
  // Which registry presses are kDecoding: Registry.KindsMatchTheBuiltPresses (tests/test_presses.cpp).
}

TEST(Decoding, BadInputIsRefusedWithAClearMessage) {
  const kvpress::ScorerFactory knorm = scorer("KnormPress");
  expect_error([&] { DecodingPress(nullptr); }, {"DecodingPress", "press must be a ScorerPress factory", "empty"});
  expect_error([&] { DecodingPress([](double) { return std::shared_ptr<const ScorerPress>(); }); },
               {"DecodingPress", "press must be a ScorerPress", "nullptr"});
  expect_error([&] { DecodingPress(knorm, 0); }, {"DecodingPress", "compression_interval", "0"});
  expect_error([&] { DecodingPress(knorm, 4, 0); }, {"DecodingPress", "target_size", "0"});
  expect_error([&] { DecodingPress(knorm, 4, 8, -1); }, {"DecodingPress", "hidden_states_buffer_size", "-1"});
  expect_error([&] { CompressionRatioDecodingPress(knorm, 1.0); },
               {"CompressionRatioDecodingPress", "target_compression_ratio", "[0, 1)", "1"});
  expect_error([&] { CompressionRatioDecodingPress(nullptr, 0.5); },
               {"CompressionRatioDecodingPress", "press must be a ScorerPress"});
  expect_error([&] { kvpress::make_press("DecodingPress", 0.5); },
               {"DecodingPress", "compression_ratio must be 0", "target_size", "0.5"});
  expect_error(
      [&] {
        kvpress::make_press("DecodingPress", 0.0, {{"press", ""}});
      },
      {"DecodingPress", "press", "must not be empty"});
  expect_error(
      [&] {
        kvpress::make_press("DecodingPress", 0.0, {{"press", "ChunkKVPress"}});
      },
      {"DecodingPress", "press must be a ScorerPress", "ChunkKVPress"});
  expect_error(
      [&] {
        kvpress::make_press("DecodingPress", 0.0, {{"target_size", "-3"}});
      },
      {"DecodingPress", "target_size", "-3"});
  expect_error(
      [&] {
        kvpress::make_press("DecodingPress", 0.0, {{"compression_interval", "x"}});
      },
      {"DecodingPress", "compression_interval", "integer", "x"});
  expect_error(
      [&] {
        kvpress::make_press("PrefillDecodingPress", 0.5, {{"decoding_press", "KnormPress"}});
      },
      {"PrefillDecodingPress", "decoding_press must be DecodingPress", "KnormPress"});
  expect_error(
      [&] {
        kvpress::make_press("PrefillDecodingPress", 0.5,
                            {{"prefilling_press", "DecodingPress"}, {"prefilling_press.compression_ratio", "0"}});
      },
      {"PrefillDecodingPress", "prefilling_press must be a prefill press", "DecodingPress"});
  expect_error(
      [&] {
        kvpress::make_press("PrefillDecodingPress", 0.5, {{"decoding_press.target_size", "4"}});
      },
      {"PrefillDecodingPress", "decoding_press.*", "without decoding_press"});
  // An inner press that needs every position's query cannot score a decoding cache.
  const DecodingPress expected(scorer("ExpectedAttentionPress"), 1, 10, 4);
  DecodingState state;
  expect_error([&] { expected.step(forward_inputs(30, 1, 7), 30, state); },
               {"DecodingPress.compress", "inner press ExpectedAttentionPress", "cannot score a decoding cache"});
  // step() needs the forward's hidden states; cos/sin must be the forward's rows.
  const DecodingPress snap(scorer("SnapKVPress", {{"window_size", "1"}}), 1, 10, 4);
  LayerInputs no_hidden = forward_inputs(30, 1, 8);
  no_hidden.hidden_states = at::Tensor();
  expect_error([&] { snap.step(no_hidden, 30, state); }, {"DecodingPress.step", "hidden_states"});
  LayerInputs bad_cos = forward_inputs(30, 1, 9);
  bad_cos.cos = at::ones({1, 8});
  expect_error([&] { snap.step(bad_cos, 30, state); }, {"DecodingPress.compress", "cos and sin must be [n, 16]"});
  expect_error([&] { snap.step(forward_inputs(30, 4, 9), 2, state); }, {"DecodingPress.step", "tokens_seen", "2"});
  // The runner needs a state with a decoding press.
  const LlamaModel& model = tiny_model();
  KVCache cache = model.new_cache();
  model.prefill(at::arange(1, 20).unsqueeze(0), cache);
  ForwardOptions opt;
  opt.press = &snap;
  expect_error(
      [&] {
        model.forward(at::ones({1, 1}, at::kLong), cache, opt);
      },
      {"LlamaModel", "DecodingPress", "press_state"});
}

// ---- in the Llama runner -------------------------------------------------------------------------

TEST(Decoding, GenerationCompressesWhileDecoding) {
  const LlamaModel& model = tiny_model();
  std::vector<int64_t> context{1};
  for (int64_t i = 0; i < 59; ++i) context.push_back(300 + (i * 37) % 200);
  const auto press = kvpress::make_press(
      "DecodingPress", 0.0, {{"press", "KeyDiffPress"}, {"compression_interval", "4"}, {"target_size", "32"}});
  kvpress::llama::GenerationOptions opt;
  opt.max_new_tokens = 10;
  opt.stop_at_eos = false;
  opt.press = press.get();
  const auto g = kvpress::llama::generate_greedy(model, context, {400, 401}, opt);
  EXPECT_EQ(g.cache_lengths, (std::vector<int64_t>{60, 60}));  // no compression at prefill
  ASSERT_EQ(g.tokens.size(), 10u);
  // Forwards: the question (1), then 9 tokens; compressions after forwards 4 and 8 -> 32 + 2.
  EXPECT_EQ(g.final_cache_lengths, (std::vector<int64_t>{34, 34}));
  // A press given to prefill directly: a DecodingPress does nothing there (kvpress's hook skips it).
  KVCache cache = model.new_cache();
  PrefillOptions p;
  p.press = press.get();
  const auto out = model.prefill(at::tensor(at::ArrayRef<int64_t>(context), at::kLong).unsqueeze(0), cache, p);
  EXPECT_TRUE(out.kept_indices.empty());
  EXPECT_EQ(cache.length(0), 60);
  // score_continuation feeds the continuation one token per forward with the decoding press.
  std::vector<int64_t> story = context;
  for (int64_t i = 0; i < 20; ++i) story.push_back(500 + i);
  const auto full = kvpress::llama::score_continuation(model, story, 60, nullptr);
  const auto pressed = kvpress::llama::score_continuation(model, story, 60, press.get());
  EXPECT_EQ(pressed.scored, full.scored);
  EXPECT_TRUE(std::isfinite(pressed.mean_nll));
  // Up to the first compression (after the 4th fed token) both read the same cache.
  EXPECT_TRUE(at::equal(pressed.argmax.narrow(0, 0, 4), full.argmax.narrow(0, 0, 4)));
}

// The runner's two hooks hand presses the same fields (one builder, LlamaModel::hook_inputs): every
// field the model has is defined in both, so a press sees the same kind of inputs at prefill and
// while decoding. The prefill adds the queries of every position it computed anyway (a decoding
// step's queries cover its new token only; the decoding press recomputes them from its buffered
// hidden states); q_norm/k_norm (Llama has none) and attentions (given on demand) stay empty.
TEST(Decoding, PrefillAndDecodingHooksFillTheSameFields) {
  const LlamaModel& model = tiny_model();
  std::vector<int64_t> context{1};
  for (int64_t i = 0; i < 39; ++i) context.push_back(300 + (i * 37) % 200);
  const at::Tensor prompt = at::tensor(at::ArrayRef<int64_t>(context), at::kLong).unsqueeze(0);
  const auto defined_fields = [](const LayerInputs& in) {
    std::vector<std::string> names;
    kvpress::for_each_field(in, [&](const kvpress::LayerInputField& field, const auto& member) {
      if constexpr (std::is_same_v<std::decay_t<decltype(member)>, at::Tensor>)
        if (member.defined()) names.push_back(field.name);
    });
    return names;
  };
  std::vector<std::string> at_prefill, while_decoding;
  const auto knorm = kvpress::make_press("KnormPress", 0.5);
  KVCache cache = model.new_cache();
  PrefillOptions p;
  p.press = knorm.get();
  p.on_compress = [&](const LayerInputs& in, const kvpress::KV&) { at_prefill = defined_fields(in); };
  model.prefill(prompt, cache, p);
  const auto decoding =
      kvpress::make_press("DecodingPress", 0.0, {{"compression_interval", "1"}, {"target_size", "8"}});
  kvpress::DecodingState state;
  kvpress::llama::ForwardOptions step;
  step.press = decoding.get();
  step.press_state = &state;
  step.on_decoding_compress = [&](const LayerInputs& in, const kvpress::KV&) { while_decoding = defined_fields(in); };
  model.forward(at::tensor({400L}, at::kLong).unsqueeze(0), cache, step);
  const std::vector<std::string> expected{"keys",   "values", "hidden_states", "q_proj",   "k_proj",
                                          "o_proj", "cos",    "sin",           "inv_freq", "input_ids"};
  std::vector<std::string> expected_at_prefill = expected;
  expected_at_prefill.insert(expected_at_prefill.begin() + 2, "queries");
  EXPECT_EQ(at_prefill, expected_at_prefill);
  EXPECT_EQ(while_decoding, expected);
}

// ---- fixtures ------------------------------------------------------------------------------------

struct DecodingFixtures {
  std::string dir;
  json manifest;
  std::string error;
};

const DecodingFixtures& decoding_fixtures() {
  static const DecodingFixtures f = [] {
    DecodingFixtures out;
    const std::string base = kvpress::testing::fixtures_dir();
    if (base.empty()) {
      out.error = std::string("KVPRESS_FIXTURES is not set; ") + kvpress::testing::fixtures_howto();
      return out;
    }
    out.dir = base + "/decoding";
    std::ifstream in(out.dir + "/decoding_manifest.json");
    if (!in) {
      out.error = "no manifest at " + out.dir +
                  "/decoding_manifest.json; generate it with "
                  "tests/reference/make_decoding_fixtures.py --out " +
                  out.dir + " (scripts/test.sh does)";
      return out;
    }
    try {
      in >> out.manifest;
    } catch (const std::exception& e) {
      out.error = std::string("malformed decoding_manifest.json: ") + e.what();
    }
    return out;
  }();
  return f;
}

#define REQUIRE_DECODING_FIXTURES()                                        \
  const DecodingFixtures& fx = decoding_fixtures();                        \
  ASSERT_TRUE(fx.error.empty()) << fx.error;                               \
  ASSERT_EQ(fx.manifest.at("kvpress_version").get<std::string>(), "0.5.5") \
      << "fixtures in " << fx.dir << " were made with another kvpress; regenerate them"

at::Tensor fixture(const std::string& file, const std::string& key) {
  const std::string path = decoding_fixtures().dir + "/" + file;
  return kvpress::testing::fixture_tensor(kvpress::testing::load_fixture_file(path), key, file);
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

std::unique_ptr<kvpress::BasePress> press_of(const json& run) {
  return kvpress::make_press(run.at("press").get<std::string>(), run.at("compression_ratio").get<double>(),
                             run.at("params").get<std::map<std::string, std::string>>());
}

// Our argmax equals the reference token unless the reference's top two logits are within tolerance.
void expect_same_argmax(const at::Tensor& ours, const at::Tensor& ref_logits, int64_t want, const std::string& what) {
  const at::Tensor top2 = std::get<0>(ref_logits.topk(2));
  if ((top2[0] - top2[1]).item<double>() <= 2 * kLogitTol) return;
  EXPECT_EQ(ours.argmax().item<int64_t>(), want) << what;
}

TEST(DecodingParity, DecodingPressesMatchKvpressPipeline) {
  REQUIRE_DECODING_FIXTURES();
  const LlamaModel& model = tiny_model();
  for (const json& run : fx.manifest.at("decoding_runs")) {
    const std::string name = run.at("name").get<std::string>(), file = run.at("file").get<std::string>();
    SCOPED_TRACE(name);
    const auto press = press_of(run);
    const bool eager = run.at("attn_implementation").get<std::string>() == "eager";
    const at::Tensor context = fixture(file, "context_ids"), question = fixture(file, "question_ids");
    const at::Tensor tokens = fixture(file, "tokens"), ref_logits = fixture(file, "logits");

    // kvpress's pipeline, with the reference's tokens fed back (teacher forcing keeps the
    // comparison meaningful even if an argmax differed).
    KVCache cache = model.new_cache();
    PrefillOptions prefill;
    prefill.press = press.get();
    const auto prefilled = model.prefill(context, cache, prefill);
    EXPECT_EQ(cache.lengths(), run.at("prefill_lengths").get<std::vector<int64_t>>());
    // The original position of every cache slot, per layer ([Hkv, length]): kept positions are
    // compared as positions (kvpress leaves a compressed cache in score order, we in position order).
    std::vector<at::Tensor> slots;
    for (int64_t l = 0; l < model.config().num_layers; ++l)
      slots.push_back(prefilled.kept_indices.empty()
                          ? at::arange(context.size(1)).expand({model.config().num_kv_heads, -1})
                          : prefilled.kept_indices[l][0]);
    struct Event {
      int64_t forward, layer, length;
      at::Tensor kept;  // [1, Hkv, n] original positions, ascending
    };
    std::vector<Event> events;
    int64_t forward = 0;
    DecodingState state;
    ForwardOptions step;
    step.last_logits_only = true;
    step.press = press.get();
    step.press_state = &state;
    step.decoding_attentions = eager;
    step.on_decoding_compress = [&](const LayerInputs& in, const KV& kv) {
      // Tokens cached since the layer's last compression: consecutive positions ending with this
      // forward's last one (cache.position() advances after the forward).
      at::Tensor& s = slots[in.layer_idx];
      const int64_t gap = in.keys.size(2) - s.size(1), last = cache.position() + in.hidden_states.size(1) - 1;
      s = at::cat({s, at::arange(last - gap + 1, last + 1).expand({s.size(0), gap})}, 1);
      s = s.gather(1, kv.kept_indices[0]);
      events.push_back({forward, in.layer_idx, in.keys.size(2), s.unsqueeze(0)});
    };
    std::vector<at::Tensor> logits{model.forward(question, cache, step).logits[0][0]};
    for (int64_t i = 0; i + 1 < tokens.size(0); ++i) {
      forward = i + 1;
      logits.push_back(model.forward(tokens.narrow(0, i, 1).view({1, 1}), cache, step).logits[0][0]);
    }
    const at::Tensor ours = at::stack(logits);
    ASSERT_EQ(ours.sizes(), ref_logits.sizes());
    EXPECT_LE(max_abs_diff(ours, ref_logits), kLogitTol) << "logits";
    for (int64_t i = 0; i < tokens.size(0); ++i)
      expect_same_argmax(ours[i], ref_logits[i], tokens[i].item<int64_t>(), "step " + std::to_string(i));
    EXPECT_EQ(cache.lengths(), run.at("final_lengths").get<std::vector<int64_t>>());

    const json& ref_events = run.at("events");
    ASSERT_EQ(events.size(), ref_events.size()) << "number of decoding compressions";
    for (size_t e = 0; e < events.size(); ++e) {
      const json& r = ref_events[e];
      SCOPED_TRACE("compression " + std::to_string(e));
      EXPECT_EQ(events[e].forward, r.at("forward").get<int64_t>());
      EXPECT_EQ(events[e].layer, r.at("layer").get<int64_t>());
      EXPECT_EQ(events[e].length, r.at("length").get<int64_t>());
      const at::Tensor ref_kept = fixture(file, r.at("kept").get<std::string>());
      ASSERT_EQ(events[e].kept.sizes(), ref_kept.sizes());
      EXPECT_TRUE(at::equal(events[e].kept, ref_kept)) << "kept positions";
    }

    // End to end: generate_greedy gives kvpress's tokens and final cache lengths.
    kvpress::llama::GenerationOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = run.at("max_new_tokens").get<int64_t>();
    opt.decoding_attentions = eager;
    const auto at_vec = [](const at::Tensor& t) {
      const at::Tensor c = t.to(at::kLong).contiguous().flatten();
      return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
    };
    const auto g = kvpress::llama::generate_greedy(model, at_vec(context), at_vec(question), opt);
    EXPECT_EQ(g.tokens, at_vec(tokens)) << "generated tokens";
    EXPECT_EQ(g.final_cache_lengths, run.at("final_lengths").get<std::vector<int64_t>>());
  }
}

TEST(DecodingParity, WrappersMatchKvpressPipeline) {
  REQUIRE_DECODING_FIXTURES();
  const LlamaModel& model = tiny_model();
  const int64_t num_layers = model.config().num_layers;
  for (const json& run : fx.manifest.at("wrapper_runs")) {
    const std::string name = run.at("name").get<std::string>(), file = run.at("file").get<std::string>();
    SCOPED_TRACE(name);
    const auto press = press_of(run);
    const int64_t prefix_len = run.at("prefix_len").get<int64_t>();
    const at::Tensor ids = fixture(file, "input_ids");
    const at::Tensor prefix = ids.narrow(1, 0, prefix_len);
    const at::Tensor question = ids.narrow(1, prefix_len, run.at("question_len").get<int64_t>());
    KVCache cache = model.new_cache();
    PrefillOptions opt;
    opt.press = press.get();  // kvpress's default (sdpa) model: no attention weights
    const auto out = model.prefill(prefix, cache, opt);
    ASSERT_EQ(static_cast<int64_t>(out.kept_indices.size()), num_layers);
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor ref = fixture(file, "kept_l" + std::to_string(l));
      ASSERT_EQ(out.kept_indices[l].sizes(), ref.sizes()) << "layer " << l;
      EXPECT_TRUE(at::equal(out.kept_indices[l], ref)) << "layer " << l << " kept positions";
    }
    // kvpress's pipeline continues at the compressed length after KeyRerotationPress; so must the runner.
    EXPECT_EQ(cache.position(), run.at("position_after_prefill").get<int64_t>()) << "position after prefill";
    const at::Tensor q = model.forward(question, cache).logits[0];
    const at::Tensor tokens = fixture(file, "decode_tokens");
    std::vector<at::Tensor> steps;
    for (int64_t i = 0; i < tokens.size(0); ++i)
      steps.push_back(model.forward(tokens.narrow(0, i, 1).view({1, 1}), cache).logits[0][0]);
    EXPECT_LE(max_abs_diff(q, fixture(file, "question_logits")), kLogitTol) << "question logits";
    EXPECT_LE(max_abs_diff(at::stack(steps), fixture(file, "decode_logits")), kLogitTol) << "decode logits";
  }
}

TEST(DecodingParity, EvalWithADecodingPressMatchesKvpress) {
  REQUIRE_DECODING_FIXTURES();
  const LlamaModel& model = tiny_model();
  for (const json& run : fx.manifest.at("eval_runs")) {
    SCOPED_TRACE(run.at("name").get<std::string>());
    const auto press = press_of(run);
    for (const json& s : run.at("stories")) {
      const std::vector<int64_t> ids = s.at("ids").get<std::vector<int64_t>>();
      const auto c = kvpress::llama::score_continuation(model, ids, s.at("prefix").get<int64_t>(), press.get());
      EXPECT_NEAR(c.mean_nll, s.at("nll").get<double>(), kLogitTol) << "story " << s.at("story");
      const std::vector<int64_t> ref = s.at("argmax").get<std::vector<int64_t>>();
      const at::Tensor ours = c.argmax.contiguous();
      ASSERT_EQ(ours.numel(), static_cast<int64_t>(ref.size()));
      EXPECT_EQ(std::vector<int64_t>(ours.data_ptr<int64_t>(), ours.data_ptr<int64_t>() + ours.numel()), ref);
    }
  }
}

}  // namespace
