// Compactor's ops and presses: leverage, non-causal chunked attention, blending, sinks, across-heads
// selection and their validation messages. Parity with kvpress itself is in test_parity.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "kvpress/kvpress.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::randn;

// RoPE tables as HF builds them.
std::pair<at::Tensor, at::Tensor> rope_tables(int64_t seq, int64_t dim, double theta = 10000.0) {
  const at::Tensor inv_freq = at::pow(theta, -at::arange(0, dim, 2, at::kDouble) / dim);
  const at::Tensor angles = at::outer(at::arange(seq, at::kDouble), inv_freq);
  const at::Tensor emb = at::cat({angles, angles}, -1);
  return {emb.cos().to(at::kFloat), emb.sin().to(at::kFloat)};
}

// Exact (unregularised) leverage of the sequence-centred keys: squared row norms of Q in Kc = QR.
at::Tensor exact_leverage(const at::Tensor& keys) {
  const at::Tensor k = keys.to(at::kDouble);
  const at::Tensor q = std::get<0>(at::linalg_qr(k - k.mean(2, true)));
  return q.pow(2).sum(-1).to(at::kFloat);
}

// kvpress's non_causal_chunked_attn written naively: pad q and k to a multiple of the chunk,
// repeat_kv, all chunks' logits at once, then the masks on the last chunk.
at::Tensor naive_column_sums(const at::Tensor& q, const at::Tensor& k_in, int64_t chunk) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const at::Tensor k = k_in.repeat_interleave(H / k_in.size(1), 1);
  const int64_t n = (S + chunk - 1) / chunk, pad = n * chunk - S;
  const at::Tensor qp = at::cat({q, at::zeros({B, H, pad, D})}, 2).view({B, H, n, chunk, D});
  const at::Tensor kp = at::cat({k, at::zeros({B, H, pad, D})}, 2).view({B, H, n, chunk, D});
  at::Tensor dots = at::matmul(qp, kp.transpose(-1, -2));  // [B, H, n, C, C]
  if (pad > 0) {
    at::Tensor last = dots.select(2, n - 1);
    const at::Tensor invalid = at::arange(chunk) >= (chunk - pad);
    last.masked_fill_(invalid.view({1, 1, chunk, 1}), 0.0);
    last.masked_fill_(invalid.view({1, 1, 1, chunk}), -1e-9);
  }
  return at::softmax(dots, -1).sum(-2).reshape({B, H, n * chunk}).narrow(-1, 0, S);
}

// ---- leverage ----------------------------------------------------------------------------------

TEST(Leverage, OutlierRowRanksFirst) {
  // 64 keys near a 4-dimensional subspace, one key far along a direction none of them uses.
  at::Tensor keys = randn({1, 1, 64, 16}, 20) * 0.01;
  keys.narrow(3, 0, 4).add_(randn({1, 1, 64, 4}, 21));
  keys[0][0][37][10] = 5.0;
  for (int64_t seed : {0, 1, 2}) {
    const at::Tensor lev = ops::leverage_scores(keys, 48, seed);
    EXPECT_EQ(lev.argmax().item<int64_t>(), 37) << "seed " << seed;
  }
  // Through the press (pre-RoPE keys from inverting RoPE on the cached keys).
  const auto [cos, sin] = rope_tables(64, 16);
  LayerInputs in;
  in.keys = ops::apply_rope(keys, cos, sin);
  in.values = randn({1, 1, 64, 16}, 22);
  in.cos = cos;
  in.sin = sin;
  const at::Tensor z = LeverageScorePress(0.5, 48, 3).score(in);
  EXPECT_EQ(z.argmax().item<int64_t>(), 37);
  const KV kv = LeverageScorePress(0.9, 48, 3).compress(in);
  EXPECT_TRUE((kv.kept_indices == 37).any().item<bool>());
}

TEST(Leverage, IdentitySketchIsTheClosedFormRidgeLeverage) {
  const at::Tensor keys = randn({2, 3, 40, 8}, 23) * 3.0;
  const at::Tensor k = keys.to(at::kDouble);
  const at::Tensor x = k - k.mean(2, true);
  const at::Tensor g = at::matmul(x.transpose(2, 3), x) + 1e-2 * at::eye(8, at::kDouble);
  const at::Tensor want = (at::matmul(x, at::linalg_inv(g)) * x).sum(-1);
  const at::Tensor got = ops::sketched_leverage(keys, at::eye(8));
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, 1e-4, 1e-6));
}

TEST(Leverage, SketchedIsCloseToExact) {
  // k = 48 >= D = 16: the sketch keeps the row space, only the ridge separates the two.
  const at::Tensor keys = randn({1, 2, 256, 16}, 24);
  const at::Tensor exact = exact_leverage(keys);
  for (int64_t seed : {0, 1}) {
    const at::Tensor approx = ops::leverage_scores(keys, 48, seed);
    EXPECT_TRUE(at::allclose(approx, exact, 2e-3, 1e-5)) << (approx - exact).abs().max().item<double>();
  }
  // D = 64 > k = 48 on keys of rank 8 (plus noise far below the ridge): the sketch still sees the
  // whole signal.
  const at::Tensor low = at::matmul(randn({1, 2, 256, 8}, 25), randn({8, 64}, 26)) + randn({1, 2, 256, 64}, 27) * 1e-5;
  const at::Tensor exact_low = ops::sketched_leverage(low, at::eye(64));
  const at::Tensor approx_low = ops::leverage_scores(low, 48, 4);
  EXPECT_LT((approx_low - exact_low).abs().max().item<double>(), 0.02 * exact_low.max().item<double>());
}

TEST(Leverage, SeededSketchIsTorchRandnAfterManualSeed) {
  const at::Tensor phi = ops::gaussian_sketch(1, 2, 8, 48, at::kFloat, at::kCPU, 1234);
  at::manual_seed(1234);
  const at::Tensor want = at::randn({1, 2, 8, 48}) * (1.0 / std::sqrt(48.0));
  EXPECT_TRUE(at::equal(phi, want));
  // bfloat16: drawn and scaled in bfloat16 like kvpress on a bf16 model.
  const at::Tensor phi_bf16 = ops::gaussian_sketch(1, 2, 8, 48, at::kBFloat16, at::kCPU, 99);
  at::manual_seed(99);
  const at::Tensor want_bf16 = (at::randn({1, 2, 8, 48}, at::kBFloat16) * (1.0 / std::sqrt(48.0))).to(at::kFloat);
  EXPECT_TRUE(at::equal(phi_bf16, want_bf16));
  // Unseeded: a fresh draw from the default generator each time.
  EXPECT_FALSE(at::equal(ops::gaussian_sketch(1, 1, 8, 4, at::kFloat, at::kCPU, -1),
                         ops::gaussian_sketch(1, 1, 8, 4, at::kFloat, at::kCPU, -1)));
}

// kvpress recomputes pre-RoPE keys from hidden states (get_prerope_key_states); given cos/sin we
// invert RoPE on the cached keys instead. Both give the same scores within float32 tolerance.
TEST(Leverage, InverseRopeAndProjectionGiveTheSameScores) {
  const int64_t seq = 96, hidden = 64, kv_heads = 2, d = 16;
  const auto [cos, sin] = rope_tables(seq, d);
  LayerInputs proj;
  proj.hidden_states = randn({1, seq, hidden}, 28);
  proj.k_proj = randn({kv_heads * d, hidden}, 29) / 8.0;
  const at::Tensor k_pre =
      at::matmul(proj.hidden_states, proj.k_proj.t()).view({1, seq, kv_heads, d}).transpose(1, 2).contiguous();
  proj.keys = ops::apply_rope(k_pre, cos, sin);
  proj.values = randn({1, kv_heads, seq, d}, 30);
  LayerInputs rope;
  rope.keys = proj.keys;
  rope.values = proj.values;
  rope.cos = cos;
  rope.sin = sin;
  const LeverageScorePress press(0.5, 48, 17);
  const at::Tensor a = press.score(proj), b = press.score(rope);
  EXPECT_TRUE(at::allclose(a, b, 1e-4, 1e-4)) << (a - b).abs().max().item<double>();
  EXPECT_TRUE(at::equal(press.compress(proj).kept_indices, press.compress(rope).kept_indices));
}

TEST(Leverage, ScoresAreTheGlobalZScore) {
  const at::Tensor keys = randn({2, 2, 50, 8}, 31);
  LayerInputs in;
  in.keys = keys;
  in.values = keys;
  const auto [cos, sin] = rope_tables(50, 8);
  in.cos = cos;
  in.sin = sin;
  const at::Tensor z = LeverageScorePress(0.5, 48, 5).score(in);
  EXPECT_NEAR(z.mean().item<double>(), 0.0, 1e-5);
  EXPECT_NEAR(z.std().item<double>(), 1.0, 1e-5);  // one std over all rows, not per head
  const at::Tensor raw = ops::leverage_scores(ops::invert_rope(keys, cos, sin), 48, 5);
  EXPECT_TRUE(at::allclose(z, ops::zscore(raw), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(ops::zscore(raw), (raw - raw.mean()) / raw.std(), 1e-6, 1e-6));
}

// ---- non-causal attention ----------------------------------------------------------------------

TEST(NonCausal, ColumnSumsEqualTheNaivePaddedComputation) {
  struct Shape {
    int64_t seq, chunk;
  };
  for (const Shape sh : {Shape{8, 4}, Shape{10, 4}, Shape{3, 8}, Shape{17, 5}, Shape{1, 4}}) {
    const at::Tensor q = randn({2, 4, sh.seq, 8}, 40 + sh.seq);
    const at::Tensor k = randn({2, 2, sh.seq, 8}, 50 + sh.seq);
    const at::Tensor got = ops::noncausal_column_sums(q, k, sh.chunk);
    const at::Tensor want = naive_column_sums(q, k, sh.chunk);
    EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << "S=" << sh.seq << " chunk=" << sh.chunk;
  }
}

TEST(NonCausal, PaddedRowsSpreadUniformWeight) {
  // One chunk of 4, 1 real position: the real query sees its key (logit q.k) and 3 pad keys at
  // -1e-9; the 3 pad queries see 0 for the real key and -1e-9 for pad keys, i.e. ~1/4 each.
  const at::Tensor q = at::full({1, 1, 1, 2}, 1.0);
  const at::Tensor k = at::full({1, 1, 1, 2}, 1.0);  // q.k = 2
  const double e2 = std::exp(2.0);
  const double want = e2 / (e2 + 3.0) + 3.0 * (1.0 / 4.0);
  EXPECT_NEAR(ops::noncausal_column_sums(q, k, 4).item<double>(), want, 1e-6);
}

TEST(NonCausal, RecomputedQueriesEqualGivenOnes) {
  const int64_t seq = 37, hidden = 32, heads = 4, kv_heads = 2, d = 8;
  const auto [cos, sin] = rope_tables(seq, d);
  LayerInputs in;
  in.keys = randn({1, kv_heads, seq, d}, 60);
  in.values = randn({1, kv_heads, seq, d}, 61);
  in.hidden_states = randn({1, seq, hidden}, 62);
  in.q_proj = randn({heads * d, hidden}, 63) / 4.0;
  in.cos = cos;
  in.sin = sin;
  const at::Tensor q_all =
      at::matmul(in.hidden_states, in.q_proj.t()).view({1, seq, heads, d}).transpose(1, 2).contiguous();
  LayerInputs given;
  given.keys = in.keys;
  given.values = in.values;
  given.queries = ops::apply_rope(q_all, cos, sin);
  for (int64_t chunk : {8, 16, 64}) {
    const at::Tensor a = ops::noncausal_column_sums(in, chunk, "test");
    const at::Tensor b = ops::noncausal_column_sums(given, chunk, "test");
    EXPECT_TRUE(at::allclose(a, b, 1e-5, 1e-5)) << "chunk " << chunk;
    EXPECT_TRUE(at::allclose(NonCausalAttnPress(0.5, chunk).score(in), NonCausalAttnPress(0.5, chunk).score(given),
                             1e-4, 1e-4));
  }
}

TEST(NonCausal, ScoresWeightByValueNormPoolAndZScore) {
  const at::Tensor q = randn({1, 4, 20, 8}, 64);
  const at::Tensor k = randn({1, 2, 20, 8}, 65);
  const at::Tensor v = randn({1, 2, 20, 8}, 66);
  const at::Tensor sums = ops::noncausal_column_sums(q, k, 8);
  // Group mean by hand, x ||v||, 3-tap average with zero padding counted, global z-score.
  at::Tensor s = sums.view({1, 2, 2, 20}).mean(2) * v.norm(2, -1);
  const at::Tensor padded = at::constant_pad_nd(s, {1, 1}, 0.0);
  s = (padded.narrow(-1, 0, 20) + padded.narrow(-1, 1, 20) + padded.narrow(-1, 2, 20)) / 3.0;
  const at::Tensor want = (s - s.mean()) / s.std();
  EXPECT_TRUE(at::allclose(ops::noncausal_attention_scores(sums, v), want, 1e-5, 1e-5));
}

// ---- blending, sinks, Compactor ----------------------------------------------------------------

// Returns scores 0, 1, 2, ... and remembers the inputs it was given.
class ProbeScorer : public ScorerPress {
 public:
  ProbeScorer() : ScorerPress(0.0) {}
  std::string name() const override { return "ProbeScorer"; }
  at::Tensor score(const LayerInputs& in) const override {
    seen = in;
    const int64_t s = in.keys.size(2);
    return at::arange(s, at::kFloat).expand({in.keys.size(0), in.keys.size(1), s}).contiguous();
  }
  mutable LayerInputs seen;
};

TEST(ScoreBlend, OneScorerGivesItsZScore) {
  LayerInputs in;
  in.keys = randn({2, 3, 30, 8}, 70);
  in.values = randn({2, 3, 30, 8}, 71);
  auto knorm = std::make_shared<KnormPress>();
  const at::Tensor z = ops::zscore(knorm->score(in));
  EXPECT_TRUE(at::allclose(ScoreBlendPress(0.5, {knorm}, {1.0}).score(in), z, 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(ScoreBlendPress(0.5, {knorm}, {2.5}).score(in), z * 2.5, 1e-6, 1e-6));
  // Two scorers: a weighted sum of the z-scores, in order.
  auto keydiff = std::make_shared<KeyDiffPress>();
  const at::Tensor both = ScoreBlendPress(0.5, {knorm, keydiff}, {0.3, 1.0}).score(in);
  EXPECT_TRUE(at::allclose(both, z * 0.3 + ops::zscore(keydiff->score(in)), 1e-6, 1e-6));
  // Without normalisation the raw scores are summed.
  const ScoreBlendPress raw(0.5, {knorm}, {2.0}, ScoreBlendOptions{0, 0, /*normalize=*/false});
  EXPECT_TRUE(at::allclose(raw.score(in), knorm->score(in) * 2.0, 1e-6, 1e-6));
}

TEST(ScoreBlend, SinksAreProtectedAndScorersSeeOnlyTheInnerSlice) {
  const int64_t seq = 20;
  const auto [cos, sin] = rope_tables(seq, 8);
  LayerInputs in;
  in.keys = randn({1, 2, seq, 8}, 72);
  in.values = randn({1, 2, seq, 8}, 73);
  in.queries = randn({1, 4, seq, 8}, 74);
  in.hidden_states = randn({1, seq, 16}, 75);
  in.cos = cos;
  in.sin = sin;
  auto probe = std::make_shared<ProbeScorer>();
  const ScoreBlendPress press(0.7, {probe}, {1.0}, ScoreBlendOptions{3, 2});
  const at::Tensor scores = press.score(in);
  // The probe saw positions 3..17 of every input.
  ASSERT_EQ(probe->seen.keys.size(2), 15);
  EXPECT_TRUE(at::equal(probe->seen.keys, in.keys.narrow(2, 3, 15)));
  EXPECT_TRUE(at::equal(probe->seen.values, in.values.narrow(2, 3, 15)));
  EXPECT_TRUE(at::equal(probe->seen.queries, in.queries.narrow(2, 3, 15)));
  EXPECT_TRUE(at::equal(probe->seen.hidden_states, in.hidden_states.narrow(1, 3, 15)));
  EXPECT_TRUE(at::equal(probe->seen.cos, cos.narrow(0, 3, 15)));
  EXPECT_EQ(probe->seen.num_heads, 4);
  // Sinks carry the maximum of the blended scores (kvpress pads with max, not max + 1).
  const double top = scores.narrow(2, 3, 15).max().item<double>();
  for (int64_t p : {0, 1, 2, 18, 19}) EXPECT_DOUBLE_EQ(scores[0][0][p].item<double>(), top);
  // At ratio 0.7 (6 kept): the five sinks and position 17, the best inner one, whose score the
  // sinks share (the padding is max, not max + 1: with 5 kept, 17 would displace sink 19).
  const KV kv = press.compress(in);
  EXPECT_TRUE(at::equal(kv.kept_indices[0][1], at::tensor({0L, 1L, 2L, 17L, 18L, 19L})));
  // A window of queries that ends in the right sink: only its rows inside the slice are passed.
  in.queries = randn({1, 4, 6, 8}, 76);  // positions 14..19
  press.score(in);
  EXPECT_TRUE(at::equal(probe->seen.queries, in.queries.narrow(2, 0, 4)));  // positions 14..17
  // Every position a sink: all equal.
  const ScoreBlendPress all_sinks(0.5, {probe}, {1.0}, ScoreBlendOptions{16, 8});
  EXPECT_TRUE(at::equal(all_sinks.score(in), at::ones({1, 2, seq})));
}

LayerInputs compactor_inputs(int64_t seq, uint64_t seed) {
  const auto [cos, sin] = rope_tables(seq, 16);
  LayerInputs in;
  in.keys = randn({1, 2, seq, 16}, seed);
  in.values = randn({1, 2, seq, 16}, seed + 1);
  in.queries = randn({1, 4, seq, 16}, seed + 2);
  in.cos = cos;
  in.sin = sin;
  return in;
}

TEST(Compactor, IsBlendingTimesLeverageZPlusAttentionZOnTheInnerSlice) {
  const int64_t seq = 300;
  const LayerInputs in = compactor_inputs(seq, 80);
  LayerInputs inner = in;
  inner.keys = in.keys.narrow(2, 8, seq - 12);
  inner.values = in.values.narrow(2, 8, seq - 12);
  inner.queries = in.queries.narrow(2, 8, seq - 12);
  inner.cos = in.cos.narrow(0, 8, seq - 12);
  inner.sin = in.sin.narrow(0, 8, seq - 12);
  const at::Tensor lev = LeverageScorePress(0.0, 48, 9).score(inner);
  const at::Tensor att = NonCausalAttnPress(0.0, 256).score(inner);
  for (const std::optional<double> blending : {std::optional<double>(), std::optional<double>(0.3)}) {
    const CompactorPress press(0.4, 8, 4, 256, 48, blending, 9);
    const double lambda = blending.value_or(0.4);
    ASSERT_EQ(press.weights(), (std::vector<double>{lambda, 1.0}));
    const at::Tensor body = lev * lambda + att;
    const at::Tensor got = press.score(in);
    EXPECT_TRUE(at::equal(got.narrow(2, 8, seq - 12), body));
    EXPECT_DOUBLE_EQ(got[0][0][0].item<double>(), body.max().item<double>());
    EXPECT_DOUBLE_EQ(got[0][1][seq - 1].item<double>(), body.max().item<double>());
  }
  // blending None follows the ratio when it changes.
  CompactorPress press(0.4);
  press.set_compression_ratio(0.7);
  EXPECT_EQ(press.weights(), (std::vector<double>{0.7, 1.0}));
}

TEST(Compactor, AcrossHeadsKeepsTheGlobalTopK) {
  const int64_t seq = 64;
  const LayerInputs in = compactor_inputs(seq, 90);
  const CompactorPress per_head(0.5, 8, 4, 256, 48, 0.3, 1);
  const CompactorPress across(0.5, 8, 4, 256, 48, 0.3, 1, TokenSelection::kAcrossHeads);
  const at::Tensor scores = across.score(in);
  const at::Tensor mask = across.keep_mask(in);
  ASSERT_EQ(mask.sizes(), (at::IntArrayRef{1, 2, seq}));
  EXPECT_EQ(mask.sum().item<int64_t>(), 2 * ops::n_kept(seq, 0.5));
  // Every kept score is >= every dropped one, over both heads together.
  EXPECT_GE(scores.masked_select(mask).min().item<double>(), scores.masked_select(~mask).max().item<double>());
  const RaggedKV ragged = across.compress_ragged(in);
  int64_t total = 0;
  for (int64_t h = 0; h < 2; ++h) {
    const HeadKV& head = ragged.at(0, h);
    total += head.kept_indices.size(0);
    EXPECT_TRUE(at::equal(head.kept_indices, mask[0][h].nonzero().view(-1)));
    EXPECT_TRUE(at::equal(head.keys, in.keys[0][h].index_select(0, head.kept_indices)));
    EXPECT_TRUE(at::equal(head.values, in.values[0][h].index_select(0, head.kept_indices)));
  }
  EXPECT_EQ(total, 2 * ops::n_kept(seq, 0.5));
  expect_error(
      [&] { across.compress(in); },
      {"CompactorPress.compress: CompactorPress keeps a different number of tokens per KV head", "compress_ragged()"});
  // Per-head selection: compress_ragged equals compress.
  const KV kv = per_head.compress(in);
  const RaggedKV same = per_head.compress_ragged(in);
  for (int64_t h = 0; h < 2; ++h) EXPECT_TRUE(at::equal(same.at(0, h).kept_indices, kv.kept_indices[0][h]));
  // Ties across heads go to the lower head, then the lower position.
  const at::Tensor tied = at::ones({1, 2, 3});
  EXPECT_TRUE(
      at::equal(ops::topk_mask_across_heads(tied, 4), at::tensor({1, 1, 1, 1, 0, 0}).to(at::kBool).view({1, 2, 3})));
}

TEST(Compactor, RegistryBuildsKvpressParameters) {
  auto press = make_press("CompactorPress", 0.25,
                          {{"blending", "0.3"}, {"sink_size_start", "2"}, {"chunk_size", "64"}, {"seed", "4"}});
  auto* c = dynamic_cast<CompactorPress*>(press.get());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->blending(), 0.3);
  EXPECT_EQ(c->sink_size_start(), 2);
  EXPECT_EQ(c->sink_size_end(), 4);
  EXPECT_EQ(c->chunk_size(), 64);
  EXPECT_EQ(c->sketch_dimension(), 48);
  EXPECT_EQ(c->seed(), 4);
  auto none = make_press("CompactorPress", 0.25, {{"blending", "None"}});
  EXPECT_FALSE(dynamic_cast<CompactorPress*>(none.get())->blending().has_value());
  auto lev = make_press("LeverageScorePress", 0.5, {{"sketch_dimension", "16"}, {"seed", "1"}});
  EXPECT_EQ(dynamic_cast<LeverageScorePress*>(lev.get())->sketch_dimension(), 16);
  auto nc = make_press("NonCausalAttnPress", 0.5, {{"chunk_size", "32"}});
  EXPECT_EQ(dynamic_cast<NonCausalAttnPress*>(nc.get())->chunk_size(), 32);
}

// ---- validation ----------------------------------------------------------------------------------

TEST(CompactorErrors, Messages) {
  expect_error([] { NonCausalAttnPress(0.5, 0); }, {"NonCausalAttnPress: chunk_size must be > 0, got 0"});
  expect_error(
      [] {
        ops::noncausal_column_sums(randn({1, 2, 8, 4}, 1), randn({1, 1, 8, 4}, 2), -1);
      },
      {"noncausal_column_sums: chunk_size must be > 0, got -1"});
  expect_error([] { CompactorPress(0.5, 8, 4, 0); }, {"CompactorPress: chunk_size must be > 0, got 0"});
  expect_error([] { LeverageScorePress(0.5, 0); }, {"LeverageScorePress: sketch_dimension must be > 0, got 0"});
  expect_error(
      [] {
        ops::leverage_scores(randn({1, 1, 8, 4}, 3), -3);
      },
      {"leverage_scores: sketch_dimension must be > 0, got -3"});
  expect_error([] { CompactorPress(0.5, 8, 4, 256, -2); }, {"CompactorPress: sketch_dimension must be > 0, got -2"});
  expect_error([] { CompactorPress(0.5, -1); }, {"CompactorPress: sink_size_start must be >= 0, got -1"});
  expect_error([] { CompactorPress(0.5, 8, 4, 256, 48, std::nan("")); }, {"CompactorPress: blending must be finite"});
  expect_error(
      [] {
        make_press("CompactorPress", 0.5, {{"blending", "lots"}});
      },
      {"CompactorPress: parameter blending must be a number or None, got 'lots'"});

  // Missing or partial queries.
  LayerInputs in;
  in.keys = randn({1, 2, 32, 8}, 4);
  in.values = randn({1, 2, 32, 8}, 5);
  expect_error([&] { NonCausalAttnPress(0.5).compress(in); },
               {"NonCausalAttnPress: needs queries of every position, or hidden_states + q_proj + cos/sin; got none "
                "of them"});
  in.queries = randn({1, 4, 16, 8}, 6);
  expect_error([&] { NonCausalAttnPress(0.5).compress(in); },
               {"NonCausalAttnPress: queries must cover every position (q_len == seq_len 32), got q_len 16"});
  in.queries = randn({1, 3, 32, 8}, 7);
  expect_error([&] { NonCausalAttnPress(0.5).score(in); },
               {"NonCausalAttnPress: num_heads must be a positive multiple of num_kv_heads (2), got 3"});
  in.queries = at::Tensor();
  in.hidden_states = randn({1, 32, 16}, 8);
  in.q_proj = randn({32, 16}, 9);
  expect_error([&] { NonCausalAttnPress(0.5).score(in); }, {"NonCausalAttnPress: cos is required but was not given"});

  // Leverage without a way to the pre-RoPE keys; CompactorPress says which of its inputs is missing.
  LayerInputs kv_only;
  kv_only.keys = randn({1, 2, 32, 8}, 10);
  kv_only.values = randn({1, 2, 32, 8}, 11);
  expect_error([&] { LeverageScorePress(0.5).score(kv_only); },
               {"LeverageScorePress: needs cos/sin (to invert RoPE on the cached keys) or hidden_states + k_proj"});
  kv_only.queries = randn({1, 4, 32, 8}, 12);
  expect_error([&] { CompactorPress(0.5).compress(kv_only); }, {"LeverageScorePress: needs cos/sin"});

  // Keys that make the Gram matrix unusable.
  at::Tensor nan_keys = randn({1, 1, 16, 8}, 13);
  nan_keys[0][0][3][2] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { ops::leverage_scores(nan_keys, 48, 0); },
               {"sketched_leverage: the Cholesky factorisation of the sketched Gram matrix failed 5 times"});
  expect_error(
      [] {
        ops::sketched_leverage(randn({1, 1, 16, 8}, 14), at::eye(4));
      },
      {"sketched_leverage: sketch must be [8, k] or [1, 1, 8, k], got [4, 4]"});

  // Blending.
  expect_error([] { ScoreBlendPress(0.5, {}, {}); },
               {"ScoreBlendPress: scorers must hold at least one press, got none"});
  expect_error(
      [] {
        ScoreBlendPress(0.5, {std::make_shared<KnormPress>()}, {1.0, 2.0});
      },
      {"ScoreBlendPress: weights must hold one weight per scorer (1), got 2"});
  expect_error(
      [] {
        ops::blend_scores({at::zeros({1, 1, 4}), at::zeros({1, 1, 5})}, {1.0, 1.0}, true);
      },
      {"blend_scores: every scores tensor must have the shape [1, 1, 4], got [1, 1, 5]"});
  expect_error(
      [] {
        ops::topk_mask_across_heads(at::zeros({1, 2, 3}), 7);
      },
      {"topk_mask_across_heads: n_total must be in [1, heads * seq_len (6)], got 7"});
}

}  // namespace
}  // namespace kvpress
