// ExpectedAttentionPress and the wrapper presses (KeyRerotation, ChunkKV, Chunk, Block, Composed):
// behaviour against direct formulas, independent of the kvpress fixtures (tests/test_parity.cpp).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "kvpress/kvpress.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::randn;

at::Tensor inv_freq_of(int64_t d) { return at::pow(10000.0, -at::arange(0, d, 2, at::kDouble) / d).to(at::kFloat); }

// cos/sin [n, d] of positions first..first+n-1 (HF layout), computed in double.
std::pair<at::Tensor, at::Tensor> rope_tables(int64_t first, int64_t n, int64_t d) {
  const at::Tensor f = at::pow(10000.0, -at::arange(0, d, 2, at::kDouble) / d);
  const at::Tensor angles = at::outer(at::arange(first, first + n, at::kDouble), f);
  const at::Tensor emb = at::cat({angles, angles}, -1);
  return {emb.cos().to(at::kFloat), emb.sin().to(at::kFloat)};
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// A layer with pre-RoPE queries/keys, their post-RoPE versions and hidden states + q_proj that
// reproduce the queries.
struct Layer {
  LayerInputs in;
  at::Tensor prerope_q;  // [1, H, S, D]
  at::Tensor prerope_k;  // [1, Hkv, S, D]
};

Layer make_layer(int64_t seq, uint64_t seed, int64_t heads = 4, int64_t kv_heads = 2, int64_t d = 8) {
  Layer l;
  const int64_t hidden = heads * d;
  const at::Tensor h = randn({1, seq, hidden}, seed);
  const at::Tensor wq = randn({heads * d, hidden}, seed + 1) * (1.0 / std::sqrt(double(hidden)));
  l.prerope_q = at::matmul(h, wq.t()).view({1, seq, heads, d}).transpose(1, 2);
  l.prerope_k = randn({1, kv_heads, seq, d}, seed + 2);
  const auto [cos, sin] = rope_tables(0, seq, d);
  l.in.keys = (l.prerope_k * cos + rotate_half(l.prerope_k) * sin).contiguous();
  l.in.values = randn({1, kv_heads, seq, d}, seed + 3);
  l.in.hidden_states = h;
  l.in.q_proj = wq;
  l.in.cos = cos;
  l.in.sin = sin;
  l.in.num_heads = heads;
  return l;
}

// ExpectedAttention written out with the EXACT per-position rotation matrices averaged.
at::Tensor expected_attention_reference(const Layer& l, int64_t n_future, int64_t n_sink, bool cov, bool vnorm,
                                        double eps) {
  const int64_t seq = l.in.keys.size(2), d = l.in.keys.size(3), kv = l.in.keys.size(1);
  const int64_t heads = l.prerope_q.size(1), g = heads / kv, n = seq - n_sink;
  const at::Tensor q = l.prerope_q.narrow(2, n_sink, n).to(at::kDouble)[0];  // [H, n, D]
  const at::Tensor mu = q.mean(1);                                           // [H, D]
  const at::Tensor c = q - mu.unsqueeze(1);
  const at::Tensor sigma = at::matmul(c.transpose(1, 2), c) / double(n);  // [H, D, D]
  // R̄ = mean_t R_t with R_t x = rope(x, t).
  const auto [cos, sin] = rope_tables(seq, n_future, d);
  const at::Tensor eye = at::eye(d, at::kDouble);
  at::Tensor R = at::zeros({d, d}, at::kDouble);
  for (int64_t t = 0; t < n_future; ++t) {
    const at::Tensor ct = cos[t].to(at::kDouble), st = sin[t].to(at::kDouble);
    R += (eye * ct.unsqueeze(1) + rotate_half(eye).t() * st.unsqueeze(1));  // columns: rope(e_j)
  }
  R /= double(n_future);
  const at::Tensor mu2 = at::matmul(mu, R.t());
  const at::Tensor sigma2 = at::matmul(R, at::matmul(sigma, R.t()));
  const at::Tensor k = l.in.keys.narrow(2, n_sink, n).to(at::kDouble)[0];  // [Hkv, n, D]
  at::Tensor out = at::zeros({kv, n}, at::kDouble);
  for (int64_t h = 0; h < heads; ++h) {
    const at::Tensor kh = k[h / g];
    at::Tensor z = at::matmul(kh, mu2[h]) / std::sqrt(double(d));
    if (cov) z = z + (at::matmul(kh, sigma2[h]) * kh).sum(-1) / double(d) / 2.0;
    out[h / g] += at::softmax(z, 0) / double(g);
  }
  if (vnorm) out = (out + eps) * l.in.values.narrow(2, n_sink, n).to(at::kDouble)[0].norm(2, {-1});
  const double pad = out.max().item<double>() + 1;
  return at::cat({at::full({kv, n_sink}, pad, at::kDouble), out}, 1).unsqueeze(0).to(at::kFloat);
}

TEST(ExpectedAttentionPress, MatchesTheFormula) {
  const Layer l = make_layer(60, 1);
  for (const auto& [cov, vnorm, eps] : {std::tuple{true, true, 0.0}, {false, true, 0.01}, {true, false, 0.0}}) {
    SCOPED_TRACE(std::to_string(cov) + std::to_string(vnorm));
    const at::Tensor ours = ExpectedAttentionPress(0.5, 32, 4, cov, vnorm, eps).score(l.in);
    const at::Tensor ref = expected_attention_reference(l, 32, 4, cov, vnorm, eps);
    EXPECT_TRUE(at::allclose(ours, ref, 1e-4, 1e-6)) << (ours - ref).abs().max();
  }
}

TEST(ExpectedAttentionPress, SameScoresFromQueriesOrHiddenStatesAndWithGivenInvFreq) {
  Layer l = make_layer(50, 2);
  const ExpectedAttentionPress press(0.5, 64, 2);
  const at::Tensor from_hidden = press.score(l.in);
  LayerInputs q = l.in;
  q.hidden_states = at::Tensor();
  q.q_proj = at::Tensor();
  q.queries = l.prerope_q * l.in.cos + rotate_half(l.prerope_q) * l.in.sin;
  EXPECT_TRUE(at::allclose(press.score(q), from_hidden, 1e-4, 1e-7));
  l.in.inv_freq = inv_freq_of(8);
  EXPECT_TRUE(at::allclose(press.score(l.in), from_hidden, 1e-4, 1e-7));
  // Sinks are always kept.
  const KV kv = ExpectedAttentionPress(0.9, 64, 4).compress(l.in);
  EXPECT_TRUE(at::equal(kv.kept_indices[0][0].narrow(0, 0, 4), at::arange(4)));
}

TEST(ExpectedAttentionPress, ValidatesItsInputs) {
  Layer l = make_layer(20, 3);
  expect_error([&] { ExpectedAttentionPress(0.5, 0); }, {"ExpectedAttentionPress", "n_future_positions must be > 0"});
  expect_error([&] { ExpectedAttentionPress(0.5, 8, 20).score(l.in); }, {"seq_len must be > n_sink (20), got 20"});
  LayerInputs bare;
  bare.keys = l.in.keys;
  bare.values = l.in.values;
  expect_error([&] { ExpectedAttentionPress(0.5).score(bare); }, {"needs hidden_states + q_proj"});
  LayerInputs no_rope = l.in;
  no_rope.cos = no_rope.sin = at::Tensor();
  expect_error([&] { ExpectedAttentionPress(0.5).score(no_rope); }, {"needs inv_freq"});
}

TEST(KeyRerotationPress, RotatesKeptKeysToTheirNewSlots) {
  Layer l = make_layer(40, 4);
  for (bool given : {false, true}) {
    if (given) l.in.inv_freq = inv_freq_of(8);
    const KeyRerotationPress press(std::make_shared<KnormPress>(0.5));
    const KV kv = press.compress(l.in);
    const KV plain = KnormPress(0.5).compress(l.in);
    ASSERT_TRUE(at::equal(kv.kept_indices, plain.kept_indices));
    EXPECT_TRUE(at::equal(kv.values, plain.values));
    // The kept pre-RoPE keys rotated to positions 0..n_kept-1.
    const int64_t n = kv.kept_indices.size(2);
    const at::Tensor pre = l.prerope_k.gather(2, kv.kept_indices.unsqueeze(-1).expand({-1, -1, -1, 8}));
    const auto [cos, sin] = rope_tables(0, n, 8);
    EXPECT_TRUE(at::allclose(kv.keys, pre * cos + rotate_half(pre) * sin, 1e-4, 1e-5));
    EXPECT_DOUBLE_EQ(press.compression_ratio(), 0.5);
  }
}

TEST(ChunkKVPress, KeepsWholeChunksWithTheBestMeanScore) {
  Layer l = make_layer(50, 5);  // chunks [0,10) ... [40,50) of 10
  // Knorm scores -||k||: make chunk 3 and the first chunk the smallest keys.
  l.in.keys.narrow(2, 30, 10).mul_(0.01);
  l.in.keys.narrow(2, 0, 10).mul_(0.1);
  const KV kv = ChunkKVPress(std::make_shared<KnormPress>(0.6), 10).compress(l.in);  // int(5 * 0.4) = 2 chunks
  const at::Tensor expected = at::cat({at::arange(0, 10), at::arange(30, 40)});
  for (int64_t h = 0; h < 2; ++h) EXPECT_TRUE(at::equal(kv.kept_indices[0][h], expected));
  // A remainder is its own chunk; shorter inputs than a chunk fall back to the inner press.
  const KV short_kv = ChunkKVPress(std::make_shared<KnormPress>(0.5), 64).compress(l.in);
  EXPECT_TRUE(at::equal(short_kv.kept_indices, KnormPress(0.5).compress(l.in).kept_indices));
  expect_error([] { ChunkKVPress(std::make_shared<KnormPress>(0.5), 0); }, {"ChunkKVPress: chunk_length must be > 0"});
  expect_error([] { ChunkKVPress(nullptr); }, {"ChunkKVPress: press must be a ScorerPress"});
}

TEST(EntropyGatedChunkKVPress, CutsImportantSpikyChunksToTheirBestTokens) {
  // Knorm scores -||k|| (summed over the 2 heads): four chunks of 5 with key norms
  //   A [1 9 9 9 9]   mean -7.4, one spike: entropy 0          (important and spiky)
  //   B [3 3.5 3 3.5 3]   mean -3.2, entropy log 3 / log 5     (important)
  //   C [5 5 5 5 6]   mean -5.2, entropy log 4 / log 5         (important)
  //   D [8 8.5 8 8.5 8]   mean -8.2, entropy log 3 / log 5
  // Lower medians: mean -7.4 (A), entropy log 3 / log 5: only A is spiky (strictly below).
  const std::vector<double> norms{1, 9, 9, 9, 9, 3, 3.5, 3, 3.5, 3, 5, 5, 5, 5, 6, 8, 8.5, 8, 8.5, 8};
  const at::Tensor keys = at::zeros({1, 2, 20, 4});
  keys.select(3, 0).copy_(at::tensor(norms, at::kDouble).to(at::kFloat).expand({1, 2, 20}));
  LayerInputs in;
  in.keys = keys;
  in.values = randn({1, 2, 20, 4}, 3);
  const auto knorm = std::make_shared<KnormPress>(0.4);  // budget int(20 * 0.6) = 12
  // B and C whole (10), then A's two best tokens (its spike, then the earlier of the ties).
  const at::Tensor two = at::cat({at::arange(0, 2), at::arange(5, 15)});
  EXPECT_TRUE(at::equal(EntropyGatedChunkKVPress(knorm, 5, 2).compress(in).kept_indices[0][1], two));
  // With low_entropy_chunk_length 1, A gives one token and D (not spiky) the last: its best, position 15.
  const at::Tensor one = at::cat({at::arange(0, 1), at::arange(5, 16)});
  EXPECT_TRUE(at::equal(EntropyGatedChunkKVPress(knorm, 5, 1).compress(in).kept_indices[0][0], one));
  expect_error([&] { EntropyGatedChunkKVPress(knorm, 5, 5); },
               {"EntropyGatedChunkKVPress: low_entropy_chunk_length must be in [1, chunk_length - 1] = [1, 4], got 5"});
  expect_error([&] { EntropyGatedChunkKVPress(knorm, 5, 0); }, {"low_entropy_chunk_length", "got 0"});
  expect_error([] { EntropyGatedChunkKVPress(nullptr); }, {"EntropyGatedChunkKVPress: press must be a ScorerPress"});
}

TEST(ChunkPress, ScoresEveryChunkAlone) {
  const Layer l = make_layer(70, 6);
  const KV kv = ChunkPress(std::make_shared<KnormPress>(0.5), 32).compress(l.in);  // 32 + 32 + 6
  std::vector<at::Tensor> parts;
  for (int64_t start = 0; start < 70; start += 32) {
    LayerInputs sub;
    const int64_t len = std::min<int64_t>(32, 70 - start);
    sub.keys = l.in.keys.narrow(2, start, len);
    sub.values = l.in.values.narrow(2, start, len);
    parts.push_back(KnormPress(0.5).compress(sub).kept_indices + start);
  }
  EXPECT_TRUE(at::equal(kv.kept_indices, at::cat(parts, -1)));
  EXPECT_EQ(kv.kept_indices.size(2), 16 + 16 + 3);
}

TEST(BlockPress, WithAPerTokenScorerEqualsTheGlobalSelection) {
  const Layer l = make_layer(100, 7);
  const KV block = BlockPress(std::make_shared<KnormPress>(0.7), 16).compress(l.in);
  EXPECT_TRUE(at::equal(block.kept_indices, KnormPress(0.7).compress(l.in).kept_indices));
  // KeyDiff depends on the candidates: still n_kept ascending positions.
  const KV kd = BlockPress(std::make_shared<KeyDiffPress>(0.5), 16).compress(l.in);
  EXPECT_EQ(kd.kept_indices.size(2), 50);
}

TEST(ComposedPress, AppliesPressesInOrder) {
  const Layer l = make_layer(80, 8);
  const ComposedPress press({std::make_shared<KnormPress>(0.5), std::make_shared<StreamingLLMPress>(0.5, 2)});
  EXPECT_DOUBLE_EQ(press.compression_ratio(), 0.75);
  const KV kv = press.compress(l.in);
  const KV first = KnormPress(0.5).compress(l.in);
  LayerInputs second;
  second.keys = first.keys;
  second.values = first.values;
  const KV then = StreamingLLMPress(0.5, 2).compress(second);
  EXPECT_TRUE(at::equal(kv.kept_indices, first.kept_indices.gather(-1, then.kept_indices)));
  EXPECT_TRUE(at::equal(kv.keys, then.keys));
  expect_error([] { ComposedPress({}); }, {"ComposedPress: presses must hold at least one press"});
}

TEST(MergingPress, FoldsTheEvictedValueIntoTheMostSimilarKeptKey) {
  // Three tokens, one head: KnormPress at 0.3 keeps the two shortest keys, k0 = (1, 0) and
  // k2 = (0.9, 0.1), and evicts k1 = (0, 2), whose cosine with k2 is s = 0.1 / |k2| (0 with k0).
  // Its value v1 = (2, 0) goes into v2 = (0, 1) with w = s · |v1| / (|v1| + |v2| + 1e-6):
  // v2' = (v2 + w v1) / (1 + w); keys and v0 stay.
  LayerInputs in;
  in.keys = at::tensor({1.0f, 0.0f, 0.0f, 2.0f, 0.9f, 0.1f}).view({1, 1, 3, 2});
  in.values = at::tensor({5.0f, 5.0f, 2.0f, 0.0f, 0.0f, 1.0f}).view({1, 1, 3, 2});
  const auto knorm = std::make_shared<KnormPress>(0.3);
  const KV kv = MergingPress(knorm).compress(in);
  EXPECT_TRUE(at::equal(kv.kept_indices, at::tensor({0, 2}, at::kLong).view({1, 1, 2})));
  EXPECT_TRUE(at::equal(kv.keys, in.keys.index_select(2, at::tensor({0, 2}, at::kLong))));
  const double s = 0.1 / std::sqrt(0.82), w = s * 2.0 / (2.0 + 1.0 + 1e-6);
  const at::Tensor want = at::tensor({5.0, 5.0, 2 * w / (1 + w), 1 / (1 + w)}, at::kFloat).view({1, 1, 2, 2});
  EXPECT_TRUE(at::allclose(kv.values, want, 1e-6, 1e-7)) << kv.values;
  // Below the similarity threshold nothing merges; the values are the kept ones.
  const KV none = MergingPress(knorm, /*similarity_threshold=*/0.2).compress(in);
  EXPECT_TRUE(at::equal(none.values, in.values.index_select(2, at::tensor({0, 2}, at::kLong))));
  // Ratio 0: the cache untouched.
  EXPECT_TRUE(MergingPress(std::make_shared<KnormPress>(0.0)).compress(in).values.is_same(in.values));
  // merge_fraction 0.5 of two evicted tokens merges only the more similar one.
  LayerInputs two = in;
  two.keys = at::tensor({1.0f, 0.0f, 0.0f, 2.0f, 0.9f, 0.1f, 2.0f, 0.1f}).view({1, 1, 4, 2});
  two.values = at::tensor({5.0f, 5.0f, 2.0f, 0.0f, 0.0f, 1.0f, 0.0f, 3.0f}).view({1, 1, 4, 2});
  const KV half = MergingPress(std::make_shared<KnormPress>(0.5), 0.0, 0.5).compress(two);
  // Kept k0, k2; evicted k1 (cos 0.11 with k2) and k3 (cos ~1 with k0): only k3 merges, into v0.
  EXPECT_TRUE(at::equal(half.values[0][0][1], two.values[0][0][2]));
  EXPECT_FALSE(at::equal(half.values[0][0][0], two.values[0][0][0]));
  expect_error([&] { MergingPress(knorm, 1.5); }, {"MergingPress: similarity_threshold must be in [0, 1], got 1.5"});
  expect_error([&] { MergingPress(knorm, 0.0, 0.0); }, {"MergingPress: merge_fraction must be in (0, 1], got 0"});
  expect_error([&] { MergingPress(nullptr); }, {"MergingPress: press must be a ScorerPress, got nullptr"});
}

TEST(MergingPress, SimilarityBlocksGiveTheFullMatrixResult) {
  // 2 heads x 6144 tokens of 256 at 0.5: 3072 evicted values per head come in 2 blocks.
  const int64_t s = 6144, hkv = 2, d = 256;
  ASSERT_GT(hkv * (s / 2) * d, MergingPress::kEvictedBlockElements);
  at::manual_seed(3);
  LayerInputs in;
  in.keys = at::randn({1, hkv, s, d});
  in.values = at::randn({1, hkv, s, d});
  const auto knorm = std::make_shared<KnormPress>(0.5);
  const KV kv = MergingPress(knorm).compress(in);
  // The definition with the whole similarity matrix at once.
  const at::Tensor kept = kv.kept_indices;
  const at::Tensor evicted_mask = at::ones({1, hkv, s}, at::kBool).scatter_(2, kept, false);
  const at::Tensor evicted = evicted_mask.nonzero().select(1, 2).view({1, hkv, s / 2});
  const auto unit = [](const at::Tensor& x) { return x / x.norm(2, -1, true).clamp_min(1e-6); };
  const at::Tensor gone_k = in.keys.gather(2, evicted.unsqueeze(-1).expand({1, hkv, s / 2, d}));
  const at::Tensor gone_v = in.values.gather(2, evicted.unsqueeze(-1).expand({1, hkv, s / 2, d}));
  const at::Tensor kept_k = in.keys.gather(2, kept.unsqueeze(-1).expand({1, hkv, s / 2, d}));
  const at::Tensor kept_v = in.values.gather(2, kept.unsqueeze(-1).expand({1, hkv, s / 2, d}));
  const auto [sim, target] = at::matmul(unit(gone_k), unit(kept_k).transpose(-1, -2)).max(-1);
  const at::Tensor target_norm = kept_v.norm(2, -1).gather(2, target), gone_norm = gone_v.norm(2, -1);
  const at::Tensor w = sim.clamp_min(0) * gone_norm / (gone_norm + target_norm + 1e-6);
  const at::Tensor sum_v =
      at::zeros_like(kept_v).scatter_add_(2, target.unsqueeze(-1).expand_as(gone_v), w.unsqueeze(-1) * gone_v);
  const at::Tensor sum_w = at::zeros(kept.sizes()).scatter_add_(2, target, w);
  const at::Tensor want = at::where((sum_w > 0).unsqueeze(-1), (kept_v + sum_v) / (1 + sum_w).unsqueeze(-1), kept_v);
  EXPECT_TRUE(at::allclose(kv.values, want, 1e-5, 1e-6)) << (kv.values - want).abs().max();
}

TEST(Registry, BuildsNestedPresses) {
  const auto chunkkv =
      make_press("ChunkKVPress", 0.4, {{"press", "SnapKVPress"}, {"press.window_size", "16"}, {"chunk_length", "10"}});
  const auto& c = dynamic_cast<const ChunkKVPress&>(*chunkkv);
  EXPECT_EQ(c.chunk_length(), 10);
  EXPECT_EQ(dynamic_cast<const SnapKVPress&>(*c.press()).window_size(), 16);
  EXPECT_DOUBLE_EQ(chunkkv->compression_ratio(), 0.4);
  const auto composed = make_press(
      "ComposedPress", 0.5,
      {{"presses", "KnormPress,SnapKVPress"}, {"presses.1.window_size", "8"}, {"presses.1.compression_ratio", "0.2"}});
  const auto& cp = dynamic_cast<const ComposedPress&>(*composed);
  ASSERT_EQ(cp.presses().size(), 2u);
  EXPECT_EQ(dynamic_cast<const SnapKVPress&>(*cp.presses()[1]).window_size(), 8);
  EXPECT_DOUBLE_EQ(composed->compression_ratio(), 1 - 0.5 * 0.8);
  EXPECT_EQ(make_press("KeyRerotationPress", 0.5)->name(), "KeyRerotationPress");  // inner defaults to KnormPress
  expect_error(
      [] {
        make_press("ChunkPress", 0.5, {{"press", "SnapKVPress"}, {"press.windows", "3"}});
      },
      {"SnapKVPress: unknown parameter 'windows'"});
  expect_error(
      [] {
        make_press("BlockPress", 0.5, {{"press", "ComposedPress"}});
      },
      {"BlockPress: press must be a ScorerPress, got ComposedPress"});
  const auto ea = make_press("ExpectedAttentionPress", 0.5, {{"n_sink", "2"}, {"use_covariance", "false"}});
  EXPECT_EQ(dynamic_cast<const ExpectedAttentionPress&>(*ea).n_sink(), 2);
  EXPECT_FALSE(dynamic_cast<const ExpectedAttentionPress&>(*ea).use_covariance());
}

}  // namespace
}  // namespace kvpress
