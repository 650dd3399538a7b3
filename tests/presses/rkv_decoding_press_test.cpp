// RKVDecodingPress against the authors' R-KV loop (R1KV with run_math.py's step_length schedule):
// the prefill kept to the budget, a window of the last queries each rotated at its own position,
// compression to the budget in the forward after the sequence reaches a multiple of divide_length.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "kvpress/llama/generation.h"
#include "kvpress/llama/model.h"
#include "kvpress/ops.h"
#include "kvpress/presses/rkv_decoding_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

namespace {

using kvpress::LayerInputs;
using kvpress::RKVDecodingPress;
using kvpress::RKVPress;
using kvpress::testing::expect_error;

constexpr int64_t kHidden = 32, kQueryHeads = 4, kKvHeads = 2, kDim = 16;

// A layer's projections and hidden states of positions 0 .. total - 1, from which every forward's
// inputs (and the queries the press should hold) are cut.
struct Sequence {
  at::Tensor hidden;    // [1, total, hidden]
  at::Tensor keys;      // [1, Hkv, total, D]
  at::Tensor values;    // [1, Hkv, total, D]
  at::Tensor q_proj;    // [Hq * D, hidden]
  at::Tensor cos, sin;  // [total, D]

  explicit Sequence(int64_t total, uint64_t seed) {
    at::manual_seed(seed);
    hidden = at::randn({1, total, kHidden});
    keys = at::randn({1, kKvHeads, total, kDim});
    values = at::randn({1, kKvHeads, total, kDim});
    q_proj = at::randn({kQueryHeads * kDim, kHidden}) * 0.2;
    std::tie(cos, sin) = kvpress::testing::rope_tables(total, kDim);
  }

  // Post-RoPE queries of positions [begin, end), each at its own position: [1, Hq, end - begin, D].
  at::Tensor queries(int64_t begin, int64_t end) const {
    const int64_t n = end - begin;
    const at::Tensor q =
        at::matmul(hidden.narrow(1, begin, n), q_proj.t()).view({1, n, kQueryHeads, kDim}).transpose(1, 2);
    const at::Tensor rotated = at::cat({-q.narrow(-1, kDim / 2, kDim / 2), q.narrow(-1, 0, kDim / 2)}, -1);
    return q * cos.narrow(0, begin, n) + rotated * sin.narrow(0, begin, n);
  }

  // A forward of positions [begin, end) whose cache holds `cache` rows (the last ones are new).
  LayerInputs forward(int64_t begin, int64_t end, const at::Tensor& cache_rows) const {
    LayerInputs in;
    in.keys = keys.index_select(2, cache_rows);
    in.values = values.index_select(2, cache_rows);
    in.hidden_states = hidden.narrow(1, begin, end - begin);
    in.q_proj = q_proj;
    in.num_heads = kQueryHeads;
    in.cos = cos.narrow(0, begin, end - begin);
    in.sin = sin.narrow(0, begin, end - begin);
    in.layer_idx = 0;
    in.num_layers = 1;
    return in;
  }
};

RKVDecodingPress::Params small_params() {
  RKVDecodingPress::Params p;
  p.budget = 24;
  p.divide_length = 10;
  p.window_size = 4;
  p.kernel_size = 3;
  return p;
}

TEST(RKVDecodingPress, CompressesInTheForwardAfterEachMultipleOfDivideLength) {
  const RKVDecodingPress press(small_params());
  EXPECT_FALSE(press.due(/*n=*/30, /*tokens_seen=*/30));  // the prefill itself
  EXPECT_TRUE(press.due(1, 31));                          // after length 30
  EXPECT_FALSE(press.due(1, 30));
  EXPECT_TRUE(press.due(2, 42));  // a forward of 2 after length 40
  EXPECT_FALSE(press.due(2, 41));
}

// The prefill and two decoding compressions, each against RKVPress on the window the authors
// hold: the last window_size queries at their own positions (the prefill's among them at first).
TEST(RKVDecodingPress, KeepsTheBudgetByTheWindowOfOwnPositionQueries) {
  const RKVDecodingPress press(small_params());
  const Sequence seq(60, 7);
  const RKVPress scorer(0.0, RKVPress::Params{4, 3});
  const auto expected_kept = [&](const at::Tensor& rows, int64_t end) {  // positions kept of `rows`
    LayerInputs in;
    in.keys = seq.keys.index_select(2, rows);
    in.values = seq.values.index_select(2, rows);
    in.queries = seq.queries(end - 4, end);
    return rows.index({kvpress::ops::topk_indices(scorer.score(in), 24)});
  };
  auto state = press.new_sequence_state();
  // Prefill of 30 tokens: the 24 best, the query window from positions 26..29.
  LayerInputs prefill = seq.forward(0, 30, at::arange(30));
  prefill.queries = seq.queries(0, 30);
  EXPECT_FALSE(press.record_prefill(prefill, *state).defined());
  const kvpress::KV first = press.compress(prefill);
  ASSERT_EQ(first.keys.size(2), 24);
  EXPECT_TRUE(at::equal(first.kept_indices, expected_kept(at::arange(30), 30)));
  // From here the cache's rows are head 0's kept positions in both heads (a cache like any other).
  const auto step = [&](int64_t position, const at::Tensor& rows) {
    return press.decoding_update(seq.forward(position, position + 1, rows), position + 1, *state);
  };
  at::Tensor rows = at::cat({first.kept_indices[0][0], at::tensor({int64_t{30}})});
  // Position 30's forward follows length 30: due. Its window: positions 27..30.
  const kvpress::DecodingUpdate at_30 = step(30, rows);
  ASSERT_EQ(at_30.kind, kvpress::DecodingUpdate::Kind::kReplace);
  EXPECT_EQ(at_30.replacement.keys.size(2), 24);
  EXPECT_TRUE(at::equal(rows.index({at_30.replacement.kept_indices}), expected_kept(rows, 31)));
  rows = rows.index({at_30.replacement.kept_indices[0][0]});
  for (int64_t p = 31; p < 40; ++p) {  // not due until the forward after length 40
    rows = at::cat({rows, at::tensor({p})});
    EXPECT_EQ(step(p, rows).kind, kvpress::DecodingUpdate::Kind::kNone) << p;
  }
  rows = at::cat({rows, at::tensor({int64_t{40}})});  // 34 rows, the window 37..40
  const kvpress::DecodingUpdate at_40 = step(40, rows);
  ASSERT_EQ(at_40.kind, kvpress::DecodingUpdate::Kind::kReplace);
  EXPECT_TRUE(at::equal(rows.index({at_40.replacement.kept_indices}), expected_kept(rows, 41)));
}

TEST(RKVDecodingPress, KeepsEverythingBelowTheBudget) {
  const RKVDecodingPress press(small_params());
  const Sequence seq(21, 9);
  LayerInputs prefill = seq.forward(0, 20, at::arange(20));
  prefill.queries = seq.queries(0, 20);
  EXPECT_EQ(press.compress(prefill).keys.size(2), 20);
  auto state = press.new_sequence_state();
  press.record_prefill(prefill, *state);
  // Due after length 20, but 21 rows < budget 24: nothing.
  EXPECT_EQ(press.decoding_update(seq.forward(20, 21, at::arange(20)), 21, *state).kind,
            kvpress::DecodingUpdate::Kind::kNone);
}

TEST(RKVDecodingPress, GeneratesWithTheBudgetInTheRunner) {
  const kvpress::llama::LlamaModel& model = kvpress::testing::tiny_model();
  std::vector<int64_t> context{1};
  for (int64_t i = 0; i < 59; ++i) context.push_back(300 + (i * 37) % 200);
  const auto press =
      kvpress::make_press("RKVDecodingPress", 0.0, {{"budget", "32"}, {"divide_length", "16"}, {"window_size", "8"}});
  kvpress::llama::GenerationOptions opt;
  opt.max_new_tokens = 18;
  opt.stop_at_eos = false;
  opt.press = press.get();
  const auto g = kvpress::llama::generate_greedy(model, context, {400, 401}, opt);
  EXPECT_EQ(g.cache_lengths, (std::vector<int64_t>{32, 32}));  // the prefill of 60 kept to the budget
  ASSERT_EQ(g.tokens.size(), 18u);
  // The question (positions 60, 61), then tokens at 62..78: the forward at 64 follows length 64 and
  // compresses 32 + 2 + 3 rows to 32; positions 65..78 add 14.
  EXPECT_EQ(g.final_cache_lengths, (std::vector<int64_t>{46, 46}));
}

TEST(RKVDecodingPress, RefusesBadParametersAndRunsOnThePagedRunner) {
  RKVDecodingPress::Params p = small_params();
  p.budget = 4;
  expect_error([&] { RKVDecodingPress{p}; }, {"RKVDecodingPress: budget must be > window_size (4), got 4"});
  p = small_params();
  p.divide_length = 0;
  expect_error([&] { RKVDecodingPress{p}; }, {"RKVDecodingPress: divide_length must be > 0, got 0"});
  const RKVDecodingPress press(small_params());
  EXPECT_EQ(kvpress::llama::LlamaModel::why_not_paged_decoding(&press), "") << "prefill_paged records its prefill";
  const auto info = kvpress::find_press("RKVDecodingPress");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->params.size(), 7u);
  EXPECT_FALSE(info->no_ratio.empty());
}

}  // namespace
