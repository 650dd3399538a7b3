// Library-level bad input (issue 12, item 6): every public function of ops.h, cache.h, calibration.h,
// registry.h and the Llama runner answers missing tensors, wrong dtypes, shapes or devices, mixed
// devices, empty batches, zero heads, out-of-range ratios and indices with a c10::Error naming the
// function, the argument, the expected and the actual value; a failed append, truncate or
// compression leaves the cache exactly as it was.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvpress/cache.h"
#include "kvpress/calibration.h"
#include "kvpress/kvpress.h"
#include "kvpress/llama/llama.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::randn;

const at::Tensor kUndefined;

at::Tensor meta(const at::Tensor& t) { return t.to(at::kMeta); }

// ---- ops.h ---------------------------------------------------------------------------------

TEST(BadInput, SelectionOps) {
  const at::Tensor scores = randn({1, 2, 10}, 1);
  expect_error([&] { ops::n_kept(-1, 0.5); }, {"n_kept: seq_len must be >= 0, got -1"});
  expect_error([&] { ops::n_kept(10, -0.5); }, {"n_kept: compression_ratio must be in [0, 1], got -0.5"});
  expect_error([&] { ops::n_kept(10, std::nan("")); }, {"n_kept: compression_ratio must be in [0, 1], got nan"});
  expect_error([&] { ops::topk_indices(kUndefined, 2); }, {"topk_indices: scores is required but was not given"});
  expect_error([&] { ops::topk_indices(scores[0], 2); },
               {"topk_indices: scores must be [batch, heads, seq_len], got [2, 10]"});
  expect_error([&] { ops::topk_indices(scores, 11); }, {"topk_indices: k must be in [1, seq_len (10)], got 11"});
  expect_error([&] { ops::topk_indices(scores, 0); }, {"topk_indices: k must be in [1, seq_len (10)], got 0"});
  expect_error([&] { ops::topk_indices(scores.to(at::kInt), 2); },
               {"topk_indices: scores must be a floating tensor, got Int"});
  expect_error(
      [&] {
        ops::topk_indices(at::zeros({0, 2, 10}), 2);
      },
      {"topk_indices: scores must be non-empty, got [0, 2, 10]"});

  const at::Tensor keys = randn({1, 2, 10, 4}, 2), idx = at::zeros({1, 2, 3}, at::kLong);
  expect_error([&] { ops::gather_kv(keys, kUndefined, idx); }, {"gather_kv: values is required but was not given"});
  expect_error([&] { ops::gather_kv(keys, keys, idx.to(at::kInt)); }, {"gather_kv: indices must be int64, got Int"});
  expect_error(
      [&] {
        ops::gather_kv(keys, keys, at::zeros({1, 3, 3}, at::kLong));
      },
      {"gather_kv: indices must be [1, 2, n_kept], got [1, 3, 3]"});
  expect_error([&] { ops::gather_kv(keys, meta(keys), idx); },
               {"gather_kv: values must be on the same device as keys (cpu), got meta"});
  expect_error([&] { ops::gather_kv(keys, keys, meta(idx)); },
               {"gather_kv: indices must be on the same device as keys (cpu), got meta"});
  expect_error(
      [&] {
        ops::gather_kv(keys, keys, at::full({1, 2, 1}, -1, at::kLong));
      },
      {"gather_kv: indices must be in [0, seq_len (10)), got values in [-1, -1]"});

  const at::Tensor mask = at::ones({1, 2, 10}, at::kBool);
  expect_error([&] { ops::topk_mask_across_heads(scores, 21); },
               {"topk_mask_across_heads: n_total must be in [1, heads * seq_len (20)], got 21"});
  expect_error([&] { ops::gather_ragged(keys, keys, mask.to(at::kInt)); }, {"keep_mask must be bool, got Int"});
  expect_error([&] { ops::gather_ragged(keys, keys, mask.narrow(2, 0, 9)); },
               {"keep_mask must be [1, 2, 10], got [1, 2, 9]"});
}

TEST(BadInput, RopeAndHeadOps) {
  const at::Tensor x = randn({1, 2, 5, 8}, 3), cos = at::ones({5, 8}), sin = at::zeros({5, 8});
  expect_error([&] { ops::apply_rope(x, cos, kUndefined); }, {"apply_rope: sin is required but was not given"});
  expect_error([&] { ops::apply_rope(x, cos.narrow(0, 0, 4), sin); },
               {"apply_rope: cos must be [5, 8] ([seq_len, head_dim]), got [4, 8]"});
  expect_error([&] { ops::invert_rope(x.narrow(3, 0, 7), cos, sin); },
               {"invert_rope: head_dim must be even for RoPE, got 7"});
  expect_error([&] { ops::apply_rope(x, meta(cos), sin); },
               {"apply_rope: cos must be on the same device as x (cpu), got meta"});
  expect_error([&] { ops::apply_rope(x.to(at::kLong), cos, sin); },
               {"apply_rope: x must be float32, float16 or bfloat16, got Long"});
  expect_error([&] { ops::rotate_half(kUndefined); }, {"rotate_half: x is required but was not given"});
  expect_error([&] { ops::rotate_half(randn({3}, 4)); }, {"rotate_half: x must have an even last dimension, got [3]"});
  expect_error(
      [&] {
        ops::group_mean(randn({1, 6, 4}, 5), 4);
      },
      {"group_mean: num_heads must be a positive multiple of num_kv_heads (4), got 6"});
  expect_error(
      [&] {
        ops::group_mean(randn({1, 6, 4}, 5), 0);
      },
      {"group_mean: num_heads must be a positive multiple of num_kv_heads (0), got 6"});
  LayerInputs none;
  expect_error([&] { ops::num_query_heads(none); }, {"num_query_heads: the number of query heads is unknown"});
}

TEST(BadInput, LayerInputOps) {
  LayerInputs in;
  in.keys = randn({1, 2, 16, 8}, 6);
  in.values = randn({1, 2, 16, 8}, 7);
  expect_error([&] { ops::window_queries(in, 4, "op"); }, {"op: needs attentions, queries, or hidden_states + q_proj"});
  expect_error([&] { ops::window_queries(in, 17, "op"); }, {"op: window_size must be < seq_len (17), got 17"});
  expect_error([&] { ops::prerope_keys(in, "op"); },
               {"op: needs cos/sin (to invert RoPE on the cached keys) or hidden_states + k_proj"});
  expect_error([&] { ops::prerope_queries(in, 0, 4, "op"); },
               {"op: needs hidden_states + q_proj, or queries of all positions + cos/sin"});
  expect_error([&] { ops::prerope_queries(in, 10, 8, "op"); },
               {"op: positions [10, 18) must lie in [0, seq_len (16))"});
  expect_error([&] { ops::rope_inv_freq(in, "op"); }, {"op: needs inv_freq (RoPE inverse frequencies) or cos/sin"});
  in.inv_freq = at::ones({3});
  expect_error([&] { ops::rope_inv_freq(in, "op"); }, {"op: inv_freq must be [4] ([head_dim / 2]), got [3]"});
  expect_error(
      [&] {
        ops::project_queries(randn({1, 4, 8}, 8), in, "op");
      },
      {"op: q_proj is required but was not given"});
  in.q_proj = randn({4 * 8, 12}, 9);
  in.num_heads = 4;
  expect_error(
      [&] {
        ops::project_queries(randn({1, 4, 8}, 8), in, "op");
      },
      {"op: q_proj must be [32, 8], got [32, 12]"});
  expect_error(
      [&] {
        ops::project_queries(randn({4, 12}, 8), in, "op");
      },
      {"op: hidden_states must be [batch, n, hidden], got [4, 12]"});
  expect_error([&] { ops::window_attention_mean(in, 4, "op"); },
               {"op: needs attentions, queries, or hidden_states + q_proj"});
  in.attentions = at::rand({1, 4, 2, 16});
  expect_error([&] { ops::window_attention_mean(in, 4, "op"); },
               {"op: attentions must hold at least the last 4 query rows, got q_len 2"});
}

TEST(BadInput, ScoreOps) {
  const at::Tensor keys = randn({1, 2, 16, 8}, 10);
  expect_error([&] { ops::key_norm_scores(kUndefined); }, {"key_norm_scores: keys is required but was not given"});
  expect_error([&] { ops::key_norm_scores(keys.to(at::kInt)); },
               {"key_norm_scores: keys must be float32, float16 or bfloat16, got Int"});
  expect_error([&] { ops::keydiff_scores(keys[0]); },
               {"keydiff_scores: keys must be [batch, kv_heads, seq_len, head_dim], got [2, 16, 8]"});
  expect_error(
      [&] {
        ops::keydiff_scores(at::zeros({0, 2, 16, 8}));
      },
      {"keydiff_scores: keys must be non-empty, got [0, 2, 16, 8]"});
  expect_error(
      [&] {
        ops::key_norm_scores(at::zeros({1, 0, 16, 8}));
      },
      {"key_norm_scores: keys must be non-empty, got [1, 0, 16, 8]"});
  expect_error([&] { ops::streaming_llm_scores(keys, 16, 0.5); },
               {"streaming_llm_scores: n_sink must be < seq_len (16), got 16"});
  expect_error([&] { ops::streaming_llm_scores(keys, 2, 1.0); },
               {"streaming_llm_scores: compression_ratio must be in [0, 1), got 1"});
  expect_error([&] { ops::random_scores(keys.narrow(2, 0, 0), 0); }, {"random_scores: keys must be non-empty"});
  expect_error([&] { ops::lagkv_scores(keys, keys, -1, 4, false); }, {"lagkv_scores: n_sink must be >= 0, got -1"});
  expect_error([&] { ops::lagkv_scores(keys, keys.narrow(2, 0, 8), 0, 4, false); },
               {"lagkv_scores: values must have the shape of keys [1, 2, 16, 8], got [1, 2, 8, 8]"});
  const at::Tensor attn = at::rand({1, 4, 3, 13});
  expect_error([&] { ops::snapkv_scores(attn, 3, 5); },
               {"snapkv_scores: num_heads must be a positive multiple of num_kv_heads (3), got 4"});
  expect_error([&] { ops::snapkv_scores(attn, 2, 4); },
               {"snapkv_scores: kernel_size must be a positive odd number, got 4"});
  expect_error(
      [&] {
        ops::snapkv_scores_from_mean(at::rand({1, 4, 13}), 2, 5, 0);
      },
      {"snapkv_scores_from_mean: window_size must be > 0, got 0"});
  expect_error([&] { ops::tova_scores(attn, 2); },
               {"tova_scores: last_attn must hold one query row, got [1, 4, 3, 13]"});
  expect_error([&] { ops::observed_attention_scores(attn, 2); },
               {"observed_attention_scores: attentions must cover every query position ([batch, num_heads, 13, 13]), "
                "got [1, 4, 3, 13]"});
  expect_error(
      [&] {
        ops::window_attention(randn({1, 4, 3, 6}, 11), keys);
      },
      {"window_attention: queries must be [1, num_heads, window, 8] to match keys, got [1, 4, 3, 6]"});
  expect_error(
      [&] {
        ops::window_attention_mean(randn({1, 4, 3, 8}, 11), meta(keys));
      },
      {"window_attention_mean: queries must be on the same device as keys (meta), got cpu"});
}

TEST(BadInput, CompactorOps) {
  const at::Tensor keys = randn({1, 2, 16, 8}, 12);
  expect_error([&] { ops::zscore(kUndefined); }, {"zscore: scores is required but was not given"});
  expect_error(
      [&] {
        ops::blend_scores({keys, keys}, {1.0}, true);
      },
      {"blend_scores: weights must hold one weight per score tensor (2), got 1"});
  expect_error([&] { ops::blend_scores({}, {}, true); }, {"blend_scores: scores must hold at least one tensor"});
  expect_error([&] { ops::gaussian_sketch(1, 2, 8, 0, at::kFloat, at::kCPU, 0); },
               {"gaussian_sketch: sketch_dimension must be > 0, got 0"});
  expect_error(
      [&] {
        ops::sketch_keys(keys, randn({6, 4}, 13));
      },
      {"sketch_keys: sketch must be [8, k] or [1, 2, 8, k], got [6, 4]"});
  expect_error(
      [&] {
        ops::ridge_leverage(randn({1, 2, 16}, 14));
      },
      {"ridge_leverage: sketched must be [batch, kv_heads, seq_len, sketch_dimension], got [1, 2, 16]"});
  expect_error([&] { ops::leverage_scores(keys, 0, 0); }, {"leverage_scores: sketch_dimension must be > 0, got 0"});
  expect_error(
      [&] {
        ops::sketched_leverage(keys, randn({1, 3, 8, 4}, 13));
      },
      {"sketched_leverage: sketch must be [8, k] or [1, 2, 8, k], got [1, 3, 8, 4]"});
  const at::Tensor cos = randn({16, 8}, 15), sin = randn({16, 8}, 16);
  expect_error(
      [&] {
        ops::sketch_prerope_keys(keys, cos, sin, randn({6, 4}, 13));
      },
      {"sketch_prerope_keys: sketch must be [8, k] or [1, 2, 8, k], got [6, 4]"});
  expect_error(
      [&] {
        ops::sketch_prerope_keys(keys, cos.narrow(0, 0, 15), sin, randn({8, 4}, 13));
      },
      {"sketch_prerope_keys: cos must be [16, 8] ([seq_len, head_dim]), got [15, 8]"});
  expect_error(
      [&] {
        ops::sketch_prerope_keys(keys.to(at::kInt), cos, sin, randn({8, 4}, 13));
      },
      {"sketch_prerope_keys: keys must be float32, float16 or bfloat16, got Int"});
  const at::Tensor sketched = randn({1, 2, 16, 4}, 17);
  expect_error(
      [&] {
        ops::cholesky_leverage(sketched, randn({1, 2, 4, 3}, 18));
      },
      {"cholesky_leverage: factor must be [1, 2, 4, 4], got [1, 2, 4, 3]"});
  expect_error(
      [&] {
        ops::cholesky_leverage(sketched, at::eye(4, at::kDouble).expand({1, 2, 4, 4}));
      },
      {"cholesky_leverage: factor must be float32, got Double"});
  expect_error(
      [&] {
        ops::cholesky_leverage(sketched.to(at::kHalf), at::eye(4).expand({1, 2, 4, 4}));
      },
      {"cholesky_leverage: sketched must be float32, got Half"});
  LayerInputs in;
  in.keys = keys;
  in.values = keys;
  expect_error([&] { ops::leverage_scores(in, 4, 0, "op"); },
               {"op: needs cos/sin (to invert RoPE on the cached keys) or hidden_states + k_proj"});
  expect_error([&] { ops::noncausal_column_sums(in, 4, "op"); }, {"op: needs "});
  expect_error(
      [&] {
        ops::noncausal_column_sums(randn({1, 4, 15, 8}, 15), keys, 4);
      },
      {"noncausal_column_sums: queries must cover every position (q_len == seq_len 16), got q_len 15"});
  expect_error(
      [&] {
        ops::noncausal_column_sums(randn({1, 4, 16, 8}, 15), keys, 0);
      },
      {"noncausal_column_sums: chunk_size must be > 0, got 0"});
  expect_error(
      [&] {
        ops::noncausal_attention_scores(randn({1, 3, 16}, 16), keys);
      },
      {"noncausal_attention_scores: num_heads must be a positive multiple of num_kv_heads (2), got 3"});
}

TEST(BadInput, RaggedAttentionOp) {
  const at::Tensor q = randn({1, 4, 1, 8}, 17), pk = randn({6, 8}, 18), offsets = at::tensor({0, 2, 6}, at::kLong);
  const at::Tensor tail = randn({1, 2, 1, 8}, 19);
  expect_error([&] { ops::ragged_attention(q, pk, pk, offsets, tail, kUndefined); },
               {"ragged_attention: tail_values is required but was not given"});
  expect_error(
      [&] {
        ops::ragged_attention(q, pk, pk, at::tensor({0, 3, 2}, at::kLong), tail, tail);
      },
      {"ragged_attention: offsets must be non-decreasing, got offsets[1] = 3 > offsets[2] = 2"});
  expect_error(
      [&] {
        ops::ragged_attention(q, pk, pk, at::tensor({0, 2, 7}, at::kLong), tail, tail);
      },
      {"ragged_attention: offsets[2] must equal the packed token count 6, got 7"});
  expect_error([&] { ops::ragged_attention(q.to(at::kHalf), pk, pk, offsets, tail, tail); },
               {"ragged_attention: packed_keys must have the dtype of queries (Half), got Float"});
  expect_error([&] { ops::ragged_attention(q, pk, pk, offsets, tail, tail, 0.0); },
               {"ragged_attention: scale must be a finite positive number, got 0"});
  expect_error(
      [&] {
        ops::ragged_attention(randn({1, 3, 1, 8}, 20), pk, pk, offsets, tail, tail);
      },
      {"ragged_attention: num_heads must be a positive multiple of num_kv_heads (2), got 3"});
}

// ---- cache.h -------------------------------------------------------------------------------

// Everything a HeadRaggedLayer shows, to compare a layer before and after a refused call.
struct RaggedState {
  int64_t appended, next_position, total;
  at::Tensor keys, values, positions, lengths;
};
RaggedState state_of(const HeadRaggedLayer& l) {
  const RaggedKV r = l.to_ragged();
  std::vector<at::Tensor> k, v, p;
  for (const auto& h : r.heads) {
    k.push_back(h.keys);
    v.push_back(h.values);
    p.push_back(h.kept_indices);
  }
  return {l.appended(), l.next_position(), l.total_tokens(), at::cat(k), at::cat(v), at::cat(p), l.lengths()};
}
void expect_same(const RaggedState& a, const RaggedState& b) {
  EXPECT_EQ(a.appended, b.appended);
  EXPECT_EQ(a.next_position, b.next_position);
  EXPECT_EQ(a.total, b.total);
  EXPECT_TRUE(at::equal(a.keys, b.keys));
  EXPECT_TRUE(at::equal(a.values, b.values));
  EXPECT_TRUE(at::equal(a.positions, b.positions));
  EXPECT_TRUE(at::equal(a.lengths, b.lengths));
}

TEST(BadInput, HeadRaggedLayerRefusesAndStaysAsItWas) {
  const at::Tensor keys = randn({1, 2, 8, 4}, 21), values = randn({1, 2, 8, 4}, 22);
  expect_error([&] { HeadRaggedLayer::from_dense(keys, kUndefined); },
               {"HeadRaggedLayer::from_dense: values is required but was not given"});
  expect_error(
      [&] {
        HeadRaggedLayer::from_mask(keys, values, at::ones({1, 2, 7}, at::kBool));
      },
      {"HeadRaggedLayer::from_mask: keep_mask must be [1, 2, 8], got [1, 2, 7]"});
  RaggedKV bad;
  bad.batch = 1;
  bad.kv_heads = 2;
  expect_error([&] { HeadRaggedLayer::from_ragged(bad); }, {"HeadRaggedLayer::from_ragged: "});
  HeadRaggedLayer empty;
  expect_error([&] { empty.append(keys, values); }, {"HeadRaggedLayer::append: the layer is empty"});
  expect_error([&] { ops::ragged_attention(randn({1, 4, 1, 4}, 23), empty); }, {"ragged_attention: layer is empty"});

  HeadRaggedLayer layer = HeadRaggedLayer::from_mask(keys, values, at::rand({1, 2, 8}) > 0.5);
  layer.append(randn({1, 2, 2, 4}, 24), randn({1, 2, 2, 4}, 25));
  const RaggedState before = state_of(layer);
  expect_error(
      [&] {
        layer.append(randn({1, 3, 1, 4}, 26), randn({1, 3, 1, 4}, 27));
      },
      {"HeadRaggedLayer::append: keys must be [1, 2, n, 4], got [1, 3, 1, 4]"});
  expect_error(
      [&] {
        layer.append(randn({1, 2, 1, 4}, 26).to(at::kHalf), randn({1, 2, 1, 4}, 27).to(at::kHalf));
      },
      {"HeadRaggedLayer::append: keys must be Float like the layer, got Half"});
  expect_error(
      [&] {
        layer.append(randn({1, 2, 1, 4}, 26), randn({1, 2, 2, 4}, 27));
      },
      {"HeadRaggedLayer::append: values must have the shape of keys [1, 2, 1, 4], got [1, 2, 2, 4]"});
  expect_error(
      [&] {
        layer.append(meta(randn({1, 2, 1, 4}, 26)), meta(randn({1, 2, 1, 4}, 27)));
      },
      {"HeadRaggedLayer::append: keys must be on cpu like the layer, got meta"});
  expect_error([&] { layer.truncate_appended(3, 20); },
               {"HeadRaggedLayer::truncate_appended: n_keep must be in [0, 2], got 3"});
  expect_error(
      [&] { layer.truncate_appended(1, 8); },
      {"HeadRaggedLayer::truncate_appended: next_position must be greater than the last position kept (8), got 8"});
  expect_error([&] { layer.keys(0, 2); }, {"HeadRaggedLayer: head (0, 2) out of range for batch 1 and kv_heads 2"});
  expect_error([&] { layer.kept_indices(-1, 0); }, {"HeadRaggedLayer: head (-1, 0) out of range"});
  expect_same(before, state_of(layer));

  HeadRaggedCache cache(2);
  expect_error([&] { cache.layer(2); }, {"HeadRaggedCache: layer 2 out of range [0, 2)"});
  expect_error([&] { cache.set_layer(-1, layer); }, {"HeadRaggedCache: layer -1 out of range [0, 2)"});
}

// ---- registry.h and calibration.h ---------------------------------------------------------

TEST(BadInput, RegistryRefusesWhatItCannotBuild) {
  expect_error([] { make_press("", 0.5); }, {"make_press: unknown press '' (known: RandomPress"});
  expect_error([] { make_press("KnormPress", 1.0); }, {"compression_ratio must be in [0, 1), got 1"});
  expect_error([] { make_press("KnormPress", -1e-9); }, {"compression_ratio must be in [0, 1), got -1e-09"});
  expect_error(
      [] {
        make_press("AdaKVPress", 0.5, {{"press", "NoSuchPress"}});
      },
      {"make_press: unknown press 'NoSuchPress'"});
  expect_error(
      [] {
        make_press("AdaKVPress", 0.5, {{"press", "ChunkKVPress"}});
      },
      {"AdaKVPress: press must be a ScorerPress, got ChunkKVPress"});
  expect_error(
      [] {
        make_press("AdaKVPress", 0.5, {{"press.window_size", "8"}});
      },
      {"KnormPress: unknown parameter 'window_size' (known: none)"});
  expect_error(
      [] {
        make_press("AdaKVPress", 0.5, {{"alpha_safeguard", "2"}});
      },
      {"AdaKVPress: alpha_safeguard must be in [0, 1], got 2"});
  expect_error(
      [] {
        make_press("ComposedPress", 0.5, {{"presses", "KnormPress,,SnapKVPress"}});
      },
      {"ComposedPress: presses must be comma-separated press names, got 'KnormPress,,SnapKVPress'"});
  expect_error(
      [] {
        make_press("PrefillDecodingPress", 0.5, {{"decoding_press.target_size", "8"}});
      },
      {"PrefillDecodingPress: parameters decoding_press.* given without decoding_press"});
  expect_error(
      [] {
        make_press("PerLayerCompressionPress", 0.5, {{"compression_ratios", "0.1,x"}});
      },
      {"PerLayerCompressionPress: parameter compression_ratios must be comma-separated numbers (one per layer), got "
       "'0.1,x'"});
  expect_error(
      [] {
        make_press("SnapKVPress", 0.5, {{"window_size", "99999999999999999999"}});
      },
      {"SnapKVPress: parameter window_size must be an integer, got '99999999999999999999'"});
  expect_error(
      [] {
        make_press("CompactorPress", 0.5, {{"blending", "inf"}});
      },
      {"CompactorPress: parameter blending must be a number or None, got 'inf'"});
}

TEST(BadInput, CalibrationRefusesBadArguments) {
  const at::Tensor keys = randn({1, 2, 8, 4}, 28), q = randn({1, 4, 2, 4}, 29);
  const at::Tensor qpos = at::tensor({6, 7}, at::kLong), kpos = at::arange(8, at::kLong);
  expect_error([&] { calibration::attention_output(q, qpos, keys, kUndefined, kpos); },
               {"attention_output: values is required but was not given"});
  expect_error([&] { calibration::attention_output(q, qpos.narrow(0, 0, 1), keys, keys, kpos); },
               {"attention_output: query_positions must be [2], got [1]"});
  expect_error([&] { calibration::attention_output(q, qpos, keys, keys, kpos.narrow(0, 0, 7)); },
               {"attention_output: key_positions must be [8] or [1, 2, 8], got [7]"});
  expect_error(
      [&] {
        calibration::attention_output(randn({1, 3, 2, 4}, 30), qpos, keys, keys, kpos);
      },
      {"attention_output: num_heads must be a positive multiple of num_kv_heads (2), got 3"});
  expect_error([] { calibration::search_max_ratio(calibration::QualityFn(), 0.1); },
               {"search_max_ratio: quality must be a function, got an empty one"});
  expect_error([] { calibration::search_max_ratio([](double) { return 1.0; }, -0.1); },
               {"search_max_ratio: tolerance must be >= 0, got -0.1"});
  calibration::SearchOptions options;
  options.max_ratio = 1.0;
  expect_error([&] { calibration::search_max_ratio([](double) { return 1.0; }, 0.1, options); },
               {"search_max_ratio: max_ratio must be in (0, 1), got 1"});
  calibration::ObservedLayer layer;
  layer.inputs.keys = keys;
  layer.inputs.values = keys;
  layer.queries = q;
  layer.query_positions = qpos;
  expect_error(
      [&] {
        calibration::search_max_ratio(
            {layer}, [](double) { return std::unique_ptr<BasePress>(); }, 0.1);
      },
      {"search_max_ratio: make_press(0.11875) must return a press, got nullptr"});
  expect_error([] { calibration::fit_calibration({}); },
               {"fit_calibration: samples must hold at least 2 samples, got 0"});
  expect_error(
      [] {
        calibration::fit_calibration({{0.0, 1.0, 1.0}, {0.5, 1.0, 1.0}});
      },
      {"fit_calibration: retention must be in (0, 1], got 0"});
  expect_error([] { calibration::retention_for_target(1.5, 1.0); },
               {"retention_for_target: tau must be in [0, 1], got 1.5"});
  expect_error([] { calibration::curve(0.5, std::nan("")); }, {"curve: b must be finite, got nan"});
  expect_error([] { calibration::attention_output_quality({}, KnormPress(0.5)); },
               {"attention_output_quality: layers must be non-empty"});
}

// ---- the Llama runner ----------------------------------------------------------------------

using llama::KVCache;
using llama::LlamaConfig;
using llama::LlamaModel;

const LlamaModel& model() {
  static const LlamaModel m = LlamaModel::load(llama::resolve_model_dir("tinystories-656k"));
  return m;
}

at::Tensor ids(std::vector<int64_t> v) { return at::tensor(at::ArrayRef<int64_t>(v), at::kLong).unsqueeze(0); }

std::string read_text(const std::string& path) {
  std::string out;
  if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
    char buffer[4096];
    for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), f)) > 0;) out.append(buffer, n);
    std::fclose(f);
  }
  return out;
}

TEST(BadInput, CheckpointsAndTokenizersThatDoNotFit) {
  const std::string dir = llama::resolve_model_dir("tinystories-656k");
  expect_error([] { LlamaConfig::load("/nonexistent/config.json"); }, {"cannot open /nonexistent/config.json"});
  expect_error([] { LlamaConfig::from_json("{\"model_type\": \"gpt2\"}"); },
               {"LlamaConfig: config.json: unsupported model_type 'gpt2'"});
  expect_error([] { llama::resolve_model_dir("no-such-model"); },
               {"resolve_model_dir: no config.json in 'no-such-model'"});
  // A folder whose weights do not match its config, or are cut short.
  kvpress::testing::TempDir broken;
  const std::string config = read_text(dir + "/config.json");
  broken.write("config.json", config);
  expect_error([&] { LlamaModel::load(broken.path); },
               {"load_safetensors: " + broken.path + "/model.safetensors: cannot open file"});
  const std::string weights = read_text(dir + "/model.safetensors");
  broken.write("model.safetensors", weights.substr(0, weights.size() / 2));
  expect_error([&] { LlamaModel::load(broken.path); }, {"load_safetensors: ", "truncated file"});
  std::string wider = config;
  const size_t at = wider.find("\"hidden_size\"");
  ASSERT_NE(at, std::string::npos);
  wider.replace(at, std::string("\"hidden_size\"").size(), "\"hidden_size\": 256, \"unused_hidden_size\"");
  broken.write("config.json", wider);
  broken.write("model.safetensors", weights);
  expect_error([&] { LlamaModel::load(broken.path); }, {"LlamaModel: ", "must be [", "for this config, got"});
  // A tokenizer.json of another model type (WordPiece, BERT's).
  expect_error([] { llama::Tokenizer::from_json(R"({"model": {"type": "WordPiece", "vocab": {}}})"); },
               {"Tokenizer: tokenizer.json: unsupported model type \"WordPiece\""});
  expect_error([] { llama::Tokenizer::from_json("not json"); }, {"Tokenizer: tokenizer.json: not valid JSON"});
  expect_error([] { llama::Tokenizer::load("/nonexistent/tokenizer.json"); },
               {"Tokenizer: cannot open /nonexistent/tokenizer.json"});
}

// Everything a KVCache shows, to compare a cache before and after a refused call.
std::vector<at::Tensor> contents(const KVCache& c) {
  std::vector<at::Tensor> out{at::tensor({c.position()}, at::kLong)};
  for (int64_t l = 0; l < c.num_layers(); ++l) {
    out.push_back(at::tensor({c.length(l)}, at::kLong));
    if (c.is_ragged(l)) {
      out.push_back(c.ragged(l).packed_keys().clone());
      out.push_back(c.ragged(l).tail_keys().clone());
    } else if (c.keys(l).defined()) {
      out.push_back(c.keys(l).clone());
      out.push_back(c.values(l).clone());
    }
  }
  return out;
}
void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "entry " << i;
}

TEST(BadInput, KVCacheRefusesAndStaysAsItWas) {
  KVCache cache(2);
  const at::Tensor k = randn({1, 2, 3, 4}, 31), v = randn({1, 2, 3, 4}, 32);
  cache.append(0, k, v);
  cache.append(1, k, v);
  cache.advance(3);
  const auto before = contents(cache);
  expect_error([&] { cache.append(2, k, v); }, {"KVCache::append: layer 2 out of range"});
  expect_error([&] { cache.append(0, k, v.narrow(2, 0, 2)); },
               {"KVCache::append: keys and values must be [batch, kv_heads, n, head_dim] of one shape, got [1, 2, 3, "
                "4] and [1, 2, 2, 4]"});
  expect_error(
      [&] {
        cache.append(0, randn({1, 3, 1, 4}, 33), randn({1, 3, 1, 4}, 34));
      },
      {"KVCache::append: new keys [1, 3, 1, 4] do not match the cache [1, 2, 3, 4]"});
  expect_error([&] { cache.append(0, k.to(at::kHalf), v.to(at::kHalf)); },
               {"KVCache::append: keys must be Float like the cache, got Half"});
  expect_error([&] { cache.append(0, meta(k), meta(v)); },
               {"KVCache::append: keys must be on cpu like the cache, got meta"});
  expect_error([&] { cache.append(0, k, v.to(at::kHalf)); },
               {"KVCache::append: values must have the dtype of keys (Float), got Half"});
  expect_error([&] { cache.replace(-1, k, v); }, {"KVCache::replace: layer -1 out of range"});
  expect_error([&] { cache.truncate({3}, 3); }, {"KVCache::truncate: expected 2 lengths, got 1"});
  expect_error([&] { cache.truncate({3, 4}, 4); }, {"KVCache::truncate: layer 1 holds 3 tokens, cannot keep 4"});
  expect_error(
      [&] {
        cache.set_keep_mask(0, at::ones({1, 2, 2}, at::kBool));
      },
      {"KVCache::set_keep_mask: keep_mask must be bool [1, 2, 3], got [1, 2, 2]"});
  expect_error([&] { cache.set_position(-1); }, {"KVCache::set_position: position must be >= 0, got -1"});
  expect_error([&] { cache.length(5); }, {"KVCache::length: layer 5 out of range [0, 2)"});
  expect_same(before, contents(cache));
}

TEST(BadInput, RunnerRefusesAndLeavesTheCacheAsItWas) {
  const LlamaModel& m = model();
  KVCache cache = m.new_cache();
  expect_error(
      [&] {
        m.prefill(ids({1, 2, 3}).to(at::kInt), cache);
      },
      {"LlamaModel: input_ids must be a non-empty int64 [batch, n] tensor"});
  expect_error(
      [&] {
        m.prefill(at::zeros({1, 0}, at::kLong), cache);
      },
      {"LlamaModel: input_ids must be a non-empty int64 [batch, n] tensor, got [1, 0]"});
  expect_error(
      [&] {
        m.prefill(ids({1, 2, m.config().vocab_size}), cache);
      },
      {"LlamaModel: input_ids must be in [0, vocab_size (", "got values in [1, "});
  expect_error([&] { m.prefill(ids({-1, 2}), cache); }, {"LlamaModel: input_ids must be in [0, vocab_size ("});
  KVCache wrong(3);
  expect_error(
      [&] {
        m.prefill(ids({1, 2, 3}), wrong);
      },
      {"LlamaModel: the cache has 3 layers, the model 2 (use new_cache())"});

  // A press that fails in the second layer: the cache is left as it was before the prefill.
  std::vector<int64_t> prompt{1};
  for (int64_t i = 0; i < 80; ++i) prompt.push_back(300 + i);
  const auto snap = make_press("SnapKVPress", 0.5, {{"window_size", "64"}});
  llama::PrefillOptions options;
  options.press = snap.get();
  options.press_attentions = llama::PressAttentions::kNever;
  int calls = 0;
  options.on_compress = [&](const LayerInputs&, const KV&) {
    TORCH_CHECK(++calls < 2, "test: the press fails in layer 1");
  };
  const auto empty_before = contents(cache);
  expect_error([&] { m.prefill(ids(prompt), cache, options); }, {"test: the press fails in layer 1"});
  expect_same(empty_before, contents(cache));
  // A later forward that fails (a decoding press without its state) after a good prefill.
  m.prefill(ids(prompt), cache);
  const auto after_prefill = contents(cache);
  const auto decoding = make_press("DecodingPress", 0.0, {{"compression_interval", "1"}, {"target_size", "8"}});
  llama::ForwardOptions step;
  step.press = decoding.get();
  expect_error([&] { m.forward(ids({5}), cache, step); },
               {"LlamaModel: DecodingPress needs a press_state (press->new_sequence_state(), one per sequence), "
                "got nullptr"});
  expect_same(after_prefill, contents(cache));
  expect_error([&] { m.prefill(ids({1}), cache); }, {"LlamaModel::prefill: the cache already holds 81 tokens"});
  // KVComposePress's prefill (its own second pass) failing in its last step.
  KVCache fresh = m.new_cache();
  const auto kvcompose = make_press("KVComposePress", 0.5);
  llama::PrefillOptions composing;
  composing.press = kvcompose.get();
  composing.on_compress = [](const LayerInputs&, const KV&) { TORCH_CHECK(false, "test: compression fails"); };
  expect_error([&] { m.prefill(ids(prompt), fresh, composing); }, {"test: compression fails"});
  expect_same(contents(m.new_cache()), contents(fresh));
  expect_error(
      [&] {
        llama::score_continuation(m, {1, 2, 3}, 2, nullptr);
      },
      {"score_continuation: prefix must be in [1, 1] for a story of 3 tokens, got 2"});
  expect_error([&] { llama::generate_greedy(m, {}, {}); },
               {"generate_greedy: context must hold at least one token, got none"});
}

}  // namespace
}  // namespace kvpress
