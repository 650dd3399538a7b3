// Every validation path raises a c10::Error naming the argument, the expected and the actual value.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kvpress/kvpress.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::randn;

LayerInputs small_layer(int64_t seq = 32) {
  LayerInputs in;
  in.keys = randn({1, 2, seq, 8}, 1);
  in.values = randn({1, 2, seq, 8}, 2);
  return in;
}

TEST(Errors, WrongRank) {
  LayerInputs in = small_layer();
  in.keys = randn({2, 8, 64}, 3);
  expect_error([&] { KnormPress(0.5).compress(in); },
               {"KnormPress.compress: keys must be [batch, kv_heads, seq_len, head_dim], got [2, 8, 64]"});
  expect_error(
      [&] {
        ops::topk_indices(at::rand({4, 5}), 2);
      },
      {"topk_indices: scores must be [batch, heads, seq_len], got [4, 5]"});
}

TEST(Errors, WrongDtype) {
  LayerInputs in = small_layer();
  in.keys = at::ones({1, 2, 32, 8}, at::kInt);
  expect_error([&] { KnormPress(0.5).compress(in); }, {"keys must be float32, float16 or bfloat16, got Int"});
  in = small_layer();
  in.values = in.values.to(at::kDouble);
  expect_error([&] { SnapKVPress(0.5).compress(in); }, {"values must be float32, float16 or bfloat16, got Double"});
  in = small_layer();
  in.values = in.values.to(at::kHalf);
  expect_error([&] { KnormPress(0.5).compress(in); }, {"values must have the dtype of keys (Float), got Half"});
  expect_error(
      [&] {
        ops::gather_kv(in.keys, in.keys, at::zeros({1, 2, 3}, at::kInt));
      },
      {"gather_kv: indices must be int64, got Int"});
}

TEST(Errors, DeviceMismatch) {
  // The meta device stands in for a second device on a machine without a GPU.
  LayerInputs in = small_layer();
  in.values = at::empty({1, 2, 32, 8}, at::TensorOptions().device(at::kMeta));
  expect_error([&] { KnormPress(0.5).compress(in); }, {"values must be on the same device as keys (cpu), got meta"});
  in = small_layer();
  in.queries = at::empty({1, 4, 32, 8}, at::TensorOptions().device(at::kMeta));
  expect_error([&] { SnapKVPress(0.5, 8).compress(in); },
               {"SnapKVPress: queries must be on the same device as keys (cpu), got meta"});
  in = small_layer();
  in.attentions = at::empty({1, 4, 32, 32}, at::TensorOptions().device(at::kMeta));
  expect_error([&] { ObservedAttentionPress(0.5).compress(in); },
               {"attentions must be on the same device as keys (cpu), got meta"});
}

TEST(Errors, RatioOutsideUnitInterval) {
  expect_error([] { KnormPress(1.0); }, {"compression_ratio must be in [0, 1), got 1"});
  expect_error([] { SnapKVPress(-0.1); }, {"compression_ratio must be in [0, 1), got -0.1"});
  expect_error([] { RandomPress(std::nan("")); }, {"compression_ratio must be in [0, 1), got nan"});
  expect_error([] { make_press("TOVAPress", 1.5); }, {"compression_ratio must be in [0, 1), got 1.5"});
  KnormPress press(0.5);
  expect_error([&] { press.set_compression_ratio(2.0); }, {"compression_ratio must be in [0, 1), got 2"});
  EXPECT_DOUBLE_EQ(press.compression_ratio(), 0.5);  // unchanged after the refused update
}

TEST(Errors, WindowNotSmallerThanSequence) {
  LayerInputs in = small_layer(64);
  in.queries = randn({1, 4, 64, 8}, 4);
  expect_error([&] { SnapKVPress(0.5, 64).compress(in); }, {"SnapKVPress: window_size must be < seq_len (64), got 64"});
  expect_error([&] { SnapKVPress(0.5, 100).compress(in); }, {"window_size must be < seq_len (64), got 100"});
  in.queries = randn({1, 4, 10, 8}, 5);
  expect_error([&] { SnapKVPress(0.5, 16).compress(in); },
               {"queries must hold at least the last 16 positions, got q_len 10"});
  expect_error([&] { StreamingLLMPress(0.5, 64).compress(in); }, {"n_sink must be < seq_len (64), got 64"});
}

TEST(Errors, QueryHeadsNotAMultipleOfKvHeads) {
  LayerInputs in = small_layer();
  in.keys = randn({1, 4, 32, 8}, 6);
  in.values = randn({1, 4, 32, 8}, 7);
  in.queries = randn({1, 6, 32, 8}, 8);
  expect_error([&] { SnapKVPress(0.5, 8).compress(in); },
               {"num_heads must be a positive multiple of num_kv_heads (4), got 6"});
  in.queries = at::Tensor();
  in.attentions = at::rand({1, 6, 32, 32});
  expect_error([&] { ObservedAttentionPress(0.5).compress(in); },
               {"num_heads must be a positive multiple of num_kv_heads (4), got 6"});
  expect_error(
      [&] {
        ops::group_mean(at::rand({1, 6, 3}), 4);
      },
      {"group_mean: num_heads must be a positive multiple of num_kv_heads (4), got 6"});
}

TEST(Errors, NaNAndInfScores) {
  LayerInputs in = small_layer();
  in.keys[0][1][3][2] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { KnormPress(0.5).compress(in); }, {"KnormPress.compress: scores must be finite, got 1 NaN"});
  expect_error(
      [] {
        ops::topk_indices(at::full({1, 1, 4}, std::numeric_limits<float>::infinity()), 2);
      },
      {"topk_indices: scores must be finite, got 4 Inf"});
}

TEST(Errors, EmptyInput) {
  LayerInputs in = small_layer();
  in.keys = at::empty({1, 2, 0, 8});
  in.values = at::empty({1, 2, 0, 8});
  expect_error([&] { KnormPress(0.5).compress(in); }, {"keys must be non-empty, got [1, 2, 0, 8]"});
  expect_error([&] { KnormPress(0.5).compress(LayerInputs{}); },
               {"KnormPress.compress: keys is required but was not given"});
  expect_error([] { ops::topk_indices(at::empty({1, 1, 0}), 1); }, {"scores must be non-empty, got [1, 1, 0]"});
}

TEST(Errors, ShapeMismatches) {
  LayerInputs in = small_layer();
  in.values = randn({1, 2, 31, 8}, 9);
  expect_error([&] { KeyDiffPress(0.5).compress(in); },
               {"values must have the shape of keys [1, 2, 32, 8], got [1, 2, 31, 8]"});
  in = small_layer();
  in.attentions = at::rand({1, 4, 32, 31});
  expect_error([&] { TOVAPress(0.5).compress(in); },
               {"attentions must be [1, num_heads, q_len, 32] to match keys, got [1, 4, 32, 31]"});
  in = small_layer();
  in.hidden_states = randn({1, 32, 16}, 10);
  in.q_proj = randn({4 * 8, 12}, 11);
  in.cos = at::ones({32, 8});
  in.sin = at::zeros({32, 8});
  expect_error([&] { SnapKVPress(0.5, 8).compress(in); }, {"q_proj must be [32, 16], got [32, 12]"});
  in.q_proj = randn({4 * 8, 16}, 12);
  in.cos = at::ones({31, 8});
  expect_error([&] { SnapKVPress(0.5, 8).compress(in); }, {"cos must be [32, 8] ([seq_len, head_dim]), got [31, 8]"});
  expect_error(
      [] {
        ops::gather_kv(at::zeros({1, 1, 4, 2}), at::zeros({1, 1, 4, 2}), at::tensor({0L, 4L}).view({1, 1, 2}));
      },
      {"gather_kv: indices must be in [0, seq_len (4)), got values in [0, 4]"});
  expect_error(
      [] {
        ops::topk_indices(at::rand({1, 1, 4}), 5);
      },
      {"topk_indices: k must be in [1, seq_len (4)], got 5"});
}

TEST(Errors, MissingInputs) {
  LayerInputs in = small_layer();
  expect_error([&] { SnapKVPress(0.5, 8).compress(in); },
               {"SnapKVPress: needs attentions, queries, or hidden_states + q_proj + cos/sin; got none of them"});
  expect_error([&] { TOVAPress(0.5).compress(in); }, {"TOVAPress: needs attentions, queries"});
  expect_error([&] { ObservedAttentionPress(0.5).compress(in); },
               {"ObservedAttentionPress: needs attentions (the full eager attention matrix); none were given"});
  in.hidden_states = randn({1, 32, 16}, 13);
  in.q_proj = randn({4 * 8, 16}, 14);
  expect_error([&] { SnapKVPress(0.5, 8).compress(in); }, {"SnapKVPress: cos is required but was not given"});
  in.attentions = at::rand({1, 4, 8, 32});
  expect_error([&] { ObservedAttentionPress(0.5).compress(in); },
               {"attentions must cover every query position ([batch, num_heads, 32, 32]), got [1, 4, 8, 32]"});
}

// validate_layer_inputs (the CLI, torch.ops.kvpress.press_compress): every cross-field check names
// the field, the expected and the actual value.
TEST(Errors, LayerInputsThatDoNotFitTogether) {
  const auto expect_invalid = [](const LayerInputs& in, const std::string& message) {
    expect_error([&] { validate_layer_inputs(in, "check"); }, {"check: " + message});
  };
  expect_invalid(LayerInputs{}, "keys [batch, kv_heads, seq_len, head_dim] are required but were not given");
  LayerInputs in = small_layer();  // [1, 2, 32, 8]
  validate_layer_inputs(in, "check");
  LayerInputs bad = in;
  bad.queries = randn({1, 4, 40, 8}, 3);
  expect_invalid(bad, "queries must be [1, num_heads, Sq, 8] with 1 <= Sq <= 32, got [1, 4, 40, 8]");
  bad = in;
  bad.queries = randn({1, 4, 4, 8}, 3);
  bad.num_heads = 8;
  expect_invalid(bad, "queries [1, 4, 4, 8] implies 4 query heads but num_heads implies 8");
  bad = in;
  bad.o_proj = randn({16, 5 * 8}, 4);
  expect_invalid(bad, "o_proj [16, 40] gives 5 query heads, not a multiple of the 2 KV heads of keys");
  bad.o_proj = randn({16, 4 * 8}, 4);
  bad.hidden_states = randn({1, 32, 12}, 5);
  expect_invalid(bad, "o_proj must be [12, num_heads * 8], got [16, 32]");
  bad = in;
  bad.cos = at::ones({32, 8});
  expect_invalid(bad, "cos and sin come together; only cos was given");
  bad.sin = at::ones({31, 8});
  expect_invalid(bad, "sin must be [32, 8] (seq_len, head_dim), got [31, 8]");
  bad = in;
  bad.input_ids = at::zeros({1, 32});
  expect_invalid(bad, "input_ids must be an integer tensor, got Float");
  bad.input_ids = at::zeros({1, 31}, at::kLong);
  expect_invalid(bad, "input_ids must be [1, 32] (batch, seq_len), got [1, 31]");
  bad = in;
  bad.q_norm = at::ones({8}, at::kInt);
  expect_invalid(bad, "q_norm must be a floating-point tensor, got Int");
  bad = in;
  bad.q_bias = at::zeros({32});
  expect_invalid(bad, "q_bias needs q_proj (the bias of that projection)");
  bad.q_proj = randn({32, 16}, 6);
  bad.q_bias = at::zeros({31});
  expect_invalid(bad, "q_bias must be [32] (q_proj's rows), got [31]");
  bad = in;
  bad.k_proj = randn({16, 16}, 7);
  bad.k_bias = at::zeros({16, 1});
  expect_invalid(bad, "k_bias must be [16] (k_proj's rows), got [16, 1]");
  bad = in;
  bad.layer_idx = 2;
  bad.num_layers = 2;
  expect_invalid(bad, "layer_idx must be in [0, 2), got 2");
  bad = in;
  bad.norm_eps = -1;
  expect_invalid(bad, "norm_eps must be a finite number >= 0, got -1");
  bad = in;
  bad.attentions = at::rand({1, 4, 8, 32}).to(at::kMeta);
  expect_invalid(bad, "attentions must be on the same device as keys (cpu), got meta");
}

TEST(Errors, BadParameters) {
  expect_error([] { make_press("SnapKV", 0.5); },
               {"make_press: unknown press 'SnapKV' (known: RandomPress, KnormPress"});
  expect_error(
      [] {
        make_press("SnapKVPress", 0.5, {{"window", "8"}});
      },
      {"SnapKVPress: unknown parameter 'window' (known: window_size, kernel_size)"});
  expect_error(
      [] {
        make_press("KnormPress", 0.5, {{"n_sink", "8"}});
      },
      {"KnormPress: unknown parameter 'n_sink' (known: none)"});
  expect_error(
      [] {
        make_press("LagKVPress", 0.5, {{"lag_size", "12x"}});
      },
      {"LagKVPress: parameter lag_size must be an integer, got '12x'"});
  expect_error(
      [] {
        make_press("LagKVPress", 0.5, {{"cross_scoring", "maybe"}});
      },
      {"parameter cross_scoring must be true or false, got 'maybe'"});
  expect_error([] { SnapKVPress(0.5, 64, 4); }, {"SnapKVPress: kernel_size must be a positive odd number, got 4"});
  expect_error([] { LagKVPress(0.5, 4, 0); }, {"LagKVPress: lag_size must be > 0, got 0"});
  expect_error([] { StreamingLLMPress(0.5, -1); }, {"StreamingLLMPress: n_sink must be >= 0, got -1"});
}

// Found by fuzzing (tests/fuzz, kvpress_fuzz_make_press; its first input "TOVAPress", 0.5):
// list_presses() ran every factory on parameters that referenced a temporary map, read after its
// lifetime (AddressSanitizer: stack-use-after-scope). The parameters are now a copy; under the
// sanitizers this test fails if the listing reads a dead object again.
TEST(Errors, RegistryListingReadsLiveParameters) {
  EXPECT_EQ(make_press("TOVAPress", 0.5)->name(), "TOVAPress");
  const PressInfo* random = find_press("RandomPress");
  ASSERT_NE(random, nullptr);
  ASSERT_EQ(random->params.size(), 1u);
  EXPECT_EQ(random->params[0].name, "seed");
  EXPECT_EQ(random->params[0].default_value, "None");
  EXPECT_EQ(find_press("TOVAPress")->params.size(), 0u);
}

}  // namespace
}  // namespace kvpress
