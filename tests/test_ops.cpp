// Unit tests of the public ops against small, hand-checkable references.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kvpress/ops.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::randn;

TEST(NKept, TruncatesLikeKvpressAndKeepsAtLeastOne) {
  EXPECT_EQ(ops::n_kept(10, 0.7), 3);
  EXPECT_EQ(ops::n_kept(100, 0.29), 71);
  EXPECT_EQ(ops::n_kept(1000, 0.9), 99);  // 1000 * (1 - 0.9) = 99.99999999999997 in double
  EXPECT_EQ(ops::n_kept(3, 0.9), 1);      // clamped to one token
  EXPECT_EQ(ops::n_kept(4096, 0.25), 3072);
  EXPECT_EQ(ops::n_kept(4096, 0.0), 4096);
  EXPECT_EQ(ops::n_kept(4096, 1.0), 0);
}

TEST(TopkIndices, KeepsHighestInAscendingPositionOrder) {
  const at::Tensor scores = at::tensor({0.1f, 0.9f, 0.3f, 0.8f, 0.2f}).view({1, 1, 5});
  const at::Tensor kept = ops::topk_indices(scores, 3);
  EXPECT_TRUE(at::equal(kept, at::tensor({1L, 2L, 3L}).view({1, 1, 3})));
}

TEST(TopkIndices, TiesGoToTheLowerPosition) {
  const at::Tensor scores = at::tensor({1.f, 0.f, 1.f, 1.f, 0.f, 1.f}).view({1, 1, 6});
  EXPECT_TRUE(at::equal(ops::topk_indices(scores, 2), at::tensor({0L, 2L}).view({1, 1, 2})));
  EXPECT_TRUE(at::equal(ops::topk_indices(scores, 5), at::tensor({0L, 1L, 2L, 3L, 5L}).view({1, 1, 5})));
}

TEST(TopkIndices, IsPerHead) {
  const at::Tensor scores = at::tensor({3.f, 2.f, 1.f, 1.f, 2.f, 3.f}).view({1, 2, 3});
  EXPECT_TRUE(at::equal(ops::topk_indices(scores, 1), at::tensor({0L, 2L}).view({1, 2, 1})));
}

// The CPU kernel selects by threshold (nth_element) instead of sorting: it must pick exactly the
// set a stable descending sort picks, also with many ties, in every floating dtype.
TEST(TopkIndices, EqualsStableSortSelectionWithManyTies) {
  at::manual_seed(3);
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t seq = 1 + at::randint(300, {1}).item<int64_t>();
    const int64_t k = 1 + at::randint(seq, {1}).item<int64_t>();
    const at::Tensor raw = trial % 2 ? at::randint(0, 4, {2, 3, seq}).to(at::kFloat) : at::randn({2, 3, seq});
    for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
      const at::Tensor scores = raw.to(dtype);
      const at::Tensor order = std::get<1>(at::sort(scores, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
      const at::Tensor expected = std::get<0>(at::sort(order.narrow(-1, 0, k), -1));
      ASSERT_TRUE(at::equal(ops::topk_indices(scores, k), expected))
          << "seq " << seq << " k " << k << " dtype " << dtype;
    }
  }
}

TEST(GatherKV, CopiesExactRowsForLargeInputs) {
  const at::Tensor keys = randn({2, 3, 500, 16}, 1), values = randn({2, 3, 500, 16}, 2);
  const at::Tensor idx = std::get<0>(at::sort(at::randperm(500, at::kLong).narrow(0, 0, 123))).expand({2, 3, 123});
  const KV kv = ops::gather_kv(keys, values, idx.contiguous());
  const at::Tensor expanded = idx.unsqueeze(-1).expand({-1, -1, -1, 16});
  EXPECT_TRUE(at::equal(kv.keys, keys.gather(2, expanded)));
  EXPECT_TRUE(at::equal(kv.values, values.gather(2, expanded)));
}

TEST(GatherKV, TakesRowsAtIndices) {
  const at::Tensor keys = at::arange(2 * 3 * 4, at::kFloat).view({1, 2, 4, 3});
  const at::Tensor values = -keys;
  const at::Tensor idx = at::tensor({1L, 3L, 0L, 2L}).view({1, 2, 2});
  const KV kv = ops::gather_kv(keys, values, idx);
  EXPECT_TRUE(at::equal(kv.keys[0][0][0], keys[0][0][1]));
  EXPECT_TRUE(at::equal(kv.keys[0][0][1], keys[0][0][3]));
  EXPECT_TRUE(at::equal(kv.values[0][1][1], values[0][1][2]));
  EXPECT_TRUE(kv.keys.is_contiguous());
  EXPECT_TRUE(at::equal(kv.kept_indices, idx));
}

// RoPE tables as HF builds them: angle(pos, i) = pos * theta^(-2i/D), both halves equal.
std::pair<at::Tensor, at::Tensor> rope_tables(int64_t seq, int64_t dim, double theta = 10000.0) {
  const at::Tensor inv_freq = at::pow(theta, -at::arange(0, dim, 2, at::kDouble) / dim);
  const at::Tensor angles = at::outer(at::arange(seq, at::kDouble), inv_freq);
  const at::Tensor emb = at::cat({angles, angles}, -1);
  return {emb.cos().to(at::kFloat), emb.sin().to(at::kFloat)};
}

TEST(Rope, RotatesEachPairByItsAngle) {
  const auto [cos, sin] = rope_tables(5, 8);
  const at::Tensor x = randn({1, 1, 5, 8}, 1);
  const at::Tensor y = ops::apply_rope(x, cos, sin);
  // Pair (i, i + D/2) at position p rotates by angle p * theta^(-2i/D).
  for (int64_t p = 0; p < 5; ++p)
    for (int64_t i = 0; i < 4; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * i / 8);
      const double x1 = x[0][0][p][i].item<double>(), x2 = x[0][0][p][i + 4].item<double>();
      EXPECT_NEAR(y[0][0][p][i].item<double>(), x1 * std::cos(a) - x2 * std::sin(a), 1e-5);
      EXPECT_NEAR(y[0][0][p][i + 4].item<double>(), x2 * std::cos(a) + x1 * std::sin(a), 1e-5);
    }
}

TEST(Rope, InverseUndoesApply) {
  const auto [cos, sin] = rope_tables(64, 16);
  const at::Tensor x = randn({2, 3, 64, 16}, 2);
  EXPECT_TRUE(at::allclose(ops::invert_rope(ops::apply_rope(x, cos, sin), cos, sin), x, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(ops::apply_rope(ops::invert_rope(x, cos, sin), cos, sin), x, 1e-5, 1e-5));
}

TEST(GroupMean, AveragesConsecutiveQueryHeads) {
  const at::Tensor x = randn({2, 8, 5}, 3);
  const at::Tensor g = ops::group_mean(x, 2);
  ASSERT_EQ(g.sizes(), (at::IntArrayRef{2, 2, 5}));
  EXPECT_TRUE(at::allclose(g.select(1, 1), x.narrow(1, 4, 4).mean(1)));
}

// Reference window attention with explicit repeat_kv and a float64 softmax.
at::Tensor naive_window_attention(const at::Tensor& q, const at::Tensor& k) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), w = q.size(2), seq = k.size(2), d = k.size(3);
  const at::Tensor rep = k.repeat_interleave(heads / kv_heads, 1).to(at::kDouble);
  at::Tensor logits = at::matmul(q.to(at::kDouble), rep.transpose(2, 3)) / std::sqrt(double(d));
  for (int64_t i = 0; i < w; ++i)
    for (int64_t j = seq - w + i + 1; j < seq; ++j) logits.select(2, i).select(-1, j).fill_(-INFINITY);
  return at::softmax(logits, -1).narrow(-1, 0, seq - w).to(at::kFloat);
}

TEST(WindowAttention, MatchesRepeatKvReferenceWithCausalMask) {
  const at::Tensor q = randn({1, 8, 4, 16}, 4);
  const at::Tensor k = randn({1, 2, 20, 16}, 5);
  const at::Tensor a = ops::window_attention(q, k);
  ASSERT_EQ(a.sizes(), (at::IntArrayRef{1, 8, 4, 16}));
  EXPECT_TRUE(at::allclose(a, naive_window_attention(q, k), 1e-5, 1e-7));
}

TEST(WindowQueries, RecomputedQueriesEqualGivenOnes) {
  const int64_t seq = 12, hidden = 32, heads = 4, kv_heads = 2, d = 8;
  const auto [cos, sin] = rope_tables(seq, d);
  LayerInputs in;
  in.keys = randn({1, kv_heads, seq, d}, 6);
  in.values = randn({1, kv_heads, seq, d}, 7);
  in.hidden_states = randn({1, seq, hidden}, 8);
  in.q_proj = randn({heads * d, hidden}, 9);
  in.cos = cos;
  in.sin = sin;
  const at::Tensor recomputed = ops::window_queries(in, 5, "test");
  // The same queries, built by hand for every position, then given directly.
  const at::Tensor all_q = at::matmul(in.hidden_states, in.q_proj.t()).view({1, seq, heads, d}).transpose(1, 2);
  LayerInputs given = in;
  given.hidden_states = at::Tensor();
  given.q_proj = at::Tensor();
  given.queries = ops::apply_rope(all_q.contiguous(), cos, sin);
  EXPECT_TRUE(at::allclose(recomputed, ops::window_queries(given, 5, "test"), 1e-5, 1e-5));
}

TEST(PreropeKeys, InverseRopeEqualsProjection) {
  const int64_t seq = 10, hidden = 24, kv_heads = 2, d = 8;
  const auto [cos, sin] = rope_tables(seq, d);
  LayerInputs in;
  in.hidden_states = randn({1, seq, hidden}, 10);
  in.k_proj = randn({kv_heads * d, hidden}, 11);
  const at::Tensor k_pre = at::matmul(in.hidden_states, in.k_proj.t()).view({1, seq, kv_heads, d}).transpose(1, 2);
  in.keys = ops::apply_rope(k_pre.contiguous(), cos, sin);
  in.values = at::zeros_like(in.keys);
  EXPECT_TRUE(at::allclose(ops::prerope_keys(in, "test"), k_pre, 1e-4, 1e-5));  // from k_proj
  in.cos = cos;
  in.sin = sin;
  EXPECT_TRUE(at::allclose(ops::prerope_keys(in, "test"), k_pre, 1e-4, 1e-5));  // inverse RoPE
}

// Qwen2's projection biases and Qwen3's per-head norms (RMSNorm over D, before RoPE) join the
// recomputed queries and pre-RoPE keys as the model computes them.
TEST(ProjectedHeads, CarryBiasesAndPerHeadNorms) {
  const int64_t seq = 12, hidden = 32, heads = 4, kv_heads = 2, d = 8;
  const double eps = 1e-6;
  const auto [cos, sin] = rope_tables(seq, d);
  LayerInputs in;
  in.hidden_states = randn({1, seq, hidden}, 20);
  in.q_proj = randn({heads * d, hidden}, 21);
  in.k_proj = randn({kv_heads * d, hidden}, 22);
  in.q_bias = randn({heads * d}, 23);
  in.k_bias = randn({kv_heads * d}, 24);
  in.q_norm = randn({d}, 25).abs() + 0.5;
  in.k_norm = randn({d}, 26).abs() + 0.5;
  in.norm_eps = eps;
  // By hand: x W^T + b, per head x * rsqrt(mean(x^2) + eps) * w.
  const auto by_hand = [&](const at::Tensor& w, const at::Tensor& b, const at::Tensor& norm, int64_t count) {
    const at::Tensor x = (at::matmul(in.hidden_states, w.t()) + b).view({1, seq, count, d});
    return (x * at::rsqrt(x.pow(2).mean(-1, true) + eps) * norm).transpose(1, 2).contiguous();
  };
  const at::Tensor q_pre = by_hand(in.q_proj, in.q_bias, in.q_norm, heads);
  const at::Tensor k_pre = by_hand(in.k_proj, in.k_bias, in.k_norm, kv_heads);
  in.keys = ops::apply_rope(k_pre, cos, sin);
  in.values = at::zeros_like(in.keys);
  validate_layer_inputs(in, "test");
  EXPECT_TRUE(at::allclose(ops::prerope_keys(in, "test"), k_pre, 1e-4, 1e-5));  // from k_proj + k_bias + k_norm
  EXPECT_TRUE(at::allclose(ops::prerope_queries(in, 0, seq, "test"), q_pre, 1e-4, 1e-5));
  in.cos = cos;
  in.sin = sin;
  EXPECT_TRUE(at::allclose(ops::window_queries(in, 5, "test"), ops::apply_rope(q_pre, cos, sin).narrow(2, seq - 5, 5),
                           1e-4, 1e-5));
  // Without the bias the queries differ: the test would see a dropped bias.
  LayerInputs unbiased = in;
  unbiased.q_bias = at::Tensor();
  EXPECT_FALSE(at::allclose(ops::prerope_queries(unbiased, 0, seq, "test"), q_pre, 1e-2, 1e-2));
}

TEST(KeyNormScores, AccumulatesInFloat32ForEveryDtype) {
  const at::Tensor keys = randn({2, 3, 17, 64}, 12);
  const at::Tensor expected = -keys.norm(2, -1);
  EXPECT_TRUE(at::allclose(ops::key_norm_scores(keys), expected, 1e-6, 1e-6));
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    const at::Tensor low = keys.to(dtype);
    const at::Tensor s = ops::key_norm_scores(low);
    EXPECT_EQ(s.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::allclose(s, -low.to(at::kFloat).norm(2, -1), 1e-6, 1e-5));
  }
}

TEST(KeyDiffScores, AreMinusCosineToTheMeanDirection) {
  const at::Tensor keys = randn({1, 2, 9, 8}, 13);
  const at::Tensor unit = keys / keys.norm(2, -1, true);
  const at::Tensor anchor = unit.mean(2, true);
  const at::Tensor expected = -(unit * anchor).sum(-1) / anchor.norm(2, -1);
  EXPECT_TRUE(at::allclose(ops::keydiff_scores(keys), expected, 1e-5, 1e-6));
}

TEST(StreamingLLMScores, ZeroOnlyThePrunedMiddle) {
  const at::Tensor keys = at::zeros({1, 1, 10, 4});
  const at::Tensor s = ops::streaming_llm_scores(keys, 2, 0.5);  // prune 5 tokens after 2 sinks
  EXPECT_TRUE(at::equal(s.view({10}), at::tensor({1.f, 1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1.f, 1.f, 1.f})));
}

TEST(RandomScores, SeededScoresAreReproducibleAndSeedDependent) {
  const at::Tensor keys = at::zeros({1, 2, 50, 4});
  EXPECT_TRUE(at::equal(ops::random_scores(keys, 7), ops::random_scores(keys, 7)));
  EXPECT_FALSE(at::equal(ops::random_scores(keys, 7), ops::random_scores(keys, 8)));
}

TEST(LagKVScores, ShortInputRampKeepsSinksAndRecent) {
  const at::Tensor keys = randn({1, 1, 10, 4}, 14);
  const at::Tensor s = ops::lagkv_scores(keys, keys, 2, 8, false).view({10});
  EXPECT_EQ(s[0].item<float>(), 1.f);
  EXPECT_EQ(s[1].item<float>(), 1.f);
  for (int64_t i = 2; i < 10; ++i) EXPECT_FLOAT_EQ(s[i].item<float>(), (i - 2) / 8.f);
}

TEST(LagKVScores, RanksWithinPartitionsAndKeepsSinkAndTail) {
  const int64_t sink = 2, lag = 4, seq = 2 + 3 * 4 + 1;  // three partitions + one leftover token
  const at::Tensor kv = randn({1, 1, seq, 6}, 15);
  const at::Tensor s = ops::lagkv_scores(kv, kv, sink, lag, false).view({seq});
  // Sinks and the tail (last partition + leftover) are 1; partitions 0 and 1 hold ranks/lag.
  for (int64_t i : {0, 1, 10, 11, 12, 13, 14}) EXPECT_EQ(s[i].item<float>(), 1.f) << i;
  for (int64_t p = 0; p < 2; ++p) {
    const at::Tensor part = std::get<0>(s.narrow(0, sink + p * lag, lag).sort());
    EXPECT_TRUE(at::equal(part, at::arange(lag, at::kFloat) / lag)) << part;
  }
}

TEST(SnapKVScores, PoolsGroupsAndPadsTheWindow) {
  // Two query heads in one group, window 2, five earlier keys.
  const at::Tensor attn = at::rand({1, 2, 2, 5});
  const at::Tensor s = ops::snapkv_scores(attn, 1, 3).view({7});
  const at::Tensor mean = attn.mean(2).mean(1).view({5});  // pooling is linear: order does not matter
  const at::Tensor padded = at::constant_pad_nd(mean, {1, 1});
  for (int64_t i = 0; i < 5; ++i) EXPECT_NEAR(s[i].item<float>(), padded.narrow(0, i, 3).sum().item<float>() / 3, 1e-6);
  const float window_score = s.narrow(0, 0, 5).max().item<float>() + 1;
  EXPECT_FLOAT_EQ(s[5].item<float>(), window_score);
  EXPECT_FLOAT_EQ(s[6].item<float>(), window_score);
}

TEST(TovaScores, ShareTheAllHeadMeanAcrossKvHeads) {
  const at::Tensor attn = at::rand({1, 4, 1, 6});
  const at::Tensor s = ops::tova_scores(attn, 2);
  ASSERT_EQ(s.sizes(), (at::IntArrayRef{1, 2, 7}));
  EXPECT_TRUE(at::allclose(s[0][0].narrow(0, 0, 6), attn.mean(1).view({6})));
  EXPECT_TRUE(at::equal(s[0][0], s[0][1]));
  EXPECT_FLOAT_EQ(s[0][0][6].item<float>(), attn.mean(1).max().item<float>() + 1);
}

TEST(ObservedAttentionScores, DivideByTheNumberOfObservers) {
  const at::Tensor attn = at::tril(at::ones({1, 2, 4, 4}));
  // Every query gives weight 1 to each visible key: key i is summed (4 - i) times.
  const at::Tensor s = ops::observed_attention_scores(attn, 1);
  EXPECT_TRUE(at::allclose(s, at::ones({1, 1, 4})));
}

}  // namespace
}  // namespace kvpress
