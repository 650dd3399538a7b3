// HeadRaggedLayer (kvpress/cache.h) and ragged_attention: the ragged layer must attend exactly
// like a dense cache whose evicted positions are masked to -inf.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kvpress/cache.h"
#include "kvpress/ops.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;

// Dense reference in float64: keys/values hold all S + n positions (the last n are the new
// tokens), keep_mask [B, Hkv, S] says which past positions are kept. New token i sees the kept
// past and new tokens 0..i. Query head j uses KV head j / G (repeat_kv).
at::Tensor masked_dense_attention(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& keep_mask, double scale) {
  const int64_t hq = queries.size(1), n = queries.size(2), hkv = keys.size(1), total = keys.size(2);
  const int64_t s = total - n, g = hq / hkv;
  const at::Tensor q = queries.to(at::kDouble);
  const at::Tensor k = keys.to(at::kDouble).repeat_interleave(g, 1), v = values.to(at::kDouble).repeat_interleave(g, 1);
  at::Tensor scores = at::matmul(q, k.transpose(2, 3)) * scale;  // [B, Hq, n, S + n]
  at::Tensor visible = at::ones({keys.size(0), hkv, n, total}, at::kBool);
  visible.narrow(3, 0, s).copy_(keep_mask.unsqueeze(2).expand({keys.size(0), hkv, n, s}));
  const at::Tensor causal = at::ones({n, n}, at::kBool).tril();  // new token i sees new tokens <= i
  visible.narrow(3, s, n).copy_(causal.expand({keys.size(0), hkv, n, n}));
  visible = visible.repeat_interleave(g, 1);
  scores = scores.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), v);
}

// Keep masks with very different per-head budgets: head h of batch row b keeps a fraction that
// varies from everything to nothing (the last head of the last row keeps no token).
at::Tensor uneven_mask(int64_t batch, int64_t kv_heads, int64_t seq_len, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor mask = at::zeros({batch, kv_heads, seq_len}, at::kBool);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t slot = b * kv_heads + h;
      const double keep =
          slot == 0 ? 1.0 : (slot == batch * kv_heads - 1 ? 0.0 : 0.05 + 0.9 * ((slot * 37) % 11) / 10.0);
      mask[b][h].copy_(at::rand({seq_len}) < keep);
    }
  }
  return mask;
}

struct Case {
  int64_t batch, kv_heads, q_heads, seq_len, n_new, dim;
};

void check_case(const Case& c, at::ScalarType dtype, double atol, double rtol, uint64_t seed) {
  const int64_t total = c.seq_len + c.n_new;
  const at::Tensor keys = testing::randn({c.batch, c.kv_heads, total, c.dim}, seed, dtype);
  const at::Tensor values = testing::randn({c.batch, c.kv_heads, total, c.dim}, seed + 1, dtype);
  const at::Tensor queries = testing::randn({c.batch, c.q_heads, c.n_new, c.dim}, seed + 2, dtype);
  const at::Tensor mask = uneven_mask(c.batch, c.kv_heads, c.seq_len, seed + 3);

  HeadRaggedLayer layer =
      HeadRaggedLayer::from_mask(keys.narrow(2, 0, c.seq_len), values.narrow(2, 0, c.seq_len), mask);
  layer.append(keys.narrow(2, c.seq_len, c.n_new), values.narrow(2, c.seq_len, c.n_new));
  const at::Tensor out = ops::ragged_attention(queries, layer);
  ASSERT_EQ(out.sizes(), queries.sizes());
  ASSERT_EQ(out.scalar_type(), dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  const at::Tensor ref = masked_dense_attention(queries, keys, values, mask, scale);
  EXPECT_TRUE(at::allclose(out.to(at::kDouble), ref, rtol, atol))
      << "dtype " << dtype << " B=" << c.batch << " Hkv=" << c.kv_heads << " Hq=" << c.q_heads << " S=" << c.seq_len
      << " n=" << c.n_new << " D=" << c.dim << " max diff " << (out.to(at::kDouble) - ref).abs().max().item<double>();
}

TEST(RaggedAttention, MatchesMaskedDenseFloat32) {
  // GQA (G = 4 and 1), decode (n = 1) and continuation (n > 1), several key blocks (S > 64),
  // a head dimension that is not a multiple of 8.
  for (const Case& c :
       {Case{2, 2, 8, 150, 1, 64}, Case{2, 2, 8, 150, 7, 64}, Case{1, 4, 4, 300, 3, 40}, Case{1, 3, 6, 20, 70, 16}})
    check_case(c, at::kFloat, 1e-5, 1e-5, 11);
}

TEST(RaggedAttention, MatchesMaskedDenseHalfPrecision) {
  // float32 accumulation; the inputs and the output are rounded to 16 bits.
  for (const Case& c : {Case{2, 2, 8, 150, 1, 64}, Case{1, 2, 4, 200, 5, 128}}) {
    check_case(c, at::kBFloat16, 2e-2, 2e-2, 21);
    check_case(c, at::kHalf, 4e-3, 4e-3, 31);
  }
}

TEST(RaggedAttention, DecodeLoopMatchesMaskedDense) {
  // Tokens appended one at a time (the tail grows geometrically); each step attends correctly.
  const int64_t batch = 1, kv_heads = 2, q_heads = 4, seq_len = 90, steps = 6, dim = 32;
  const at::Tensor keys = testing::randn({batch, kv_heads, seq_len + steps, dim}, 5);
  const at::Tensor values = testing::randn({batch, kv_heads, seq_len + steps, dim}, 6);
  const at::Tensor mask = uneven_mask(batch, kv_heads, seq_len, 7);
  HeadRaggedLayer layer = HeadRaggedLayer::from_mask(keys.narrow(2, 0, seq_len), values.narrow(2, 0, seq_len), mask);
  const void* packed_storage = layer.packed_keys().data_ptr();
  for (int64_t t = 0; t < steps; ++t) {
    layer.append(keys.narrow(2, seq_len + t, 1), values.narrow(2, seq_len + t, 1));
    const at::Tensor q = testing::randn({batch, q_heads, 1, dim}, 100 + t);
    const int64_t upto = seq_len + t + 1;
    // Reference over positions 0..upto-1: tokens appended earlier are past tokens kept by every head.
    const at::Tensor past_mask = at::cat({mask, at::ones({batch, kv_heads, t}, at::kBool)}, 2);
    const at::Tensor ref = masked_dense_attention(q, keys.narrow(2, 0, upto), values.narrow(2, 0, upto), past_mask,
                                                  1.0 / std::sqrt(static_cast<double>(dim)));
    EXPECT_TRUE(at::allclose(ops::ragged_attention(q, layer).to(at::kDouble), ref, 1e-5, 1e-5)) << "step " << t;
  }
  EXPECT_EQ(layer.packed_keys().data_ptr(), packed_storage) << "appending must not copy the packed tokens";
  EXPECT_EQ(layer.appended(), steps);
  EXPECT_EQ(layer.next_position(), seq_len + steps);
}

TEST(RaggedAttention, DenseLayerEqualsCausalAttention) {
  // from_dense keeps everything: plain causal attention with an explicit scale.
  const at::Tensor keys = testing::randn({1, 2, 40, 16}, 8), values = testing::randn({1, 2, 40, 16}, 9);
  const at::Tensor q = testing::randn({1, 4, 4, 16}, 10);
  HeadRaggedLayer layer = HeadRaggedLayer::from_dense(keys.narrow(2, 0, 36), values.narrow(2, 0, 36));
  layer.append(keys.narrow(2, 36, 4), values.narrow(2, 36, 4));
  const at::Tensor ref = masked_dense_attention(q, keys, values, at::ones({1, 2, 36}, at::kBool), 0.3);
  EXPECT_TRUE(at::allclose(ops::ragged_attention(q, layer, 0.3).to(at::kDouble), ref, 1e-5, 1e-5));
}

TEST(HeadRaggedLayer, FromRaggedEqualsFromMask) {
  const at::Tensor keys = testing::randn({2, 3, 50, 8}, 12), values = testing::randn({2, 3, 50, 8}, 13);
  const at::Tensor mask = uneven_mask(2, 3, 50, 14);
  const RaggedKV kv = ops::gather_ragged(keys, values, mask);
  const HeadRaggedLayer a = HeadRaggedLayer::from_ragged(kv), b = HeadRaggedLayer::from_mask(keys, values, mask);
  EXPECT_TRUE(at::equal(a.packed_keys(), b.packed_keys()));
  EXPECT_TRUE(at::equal(a.packed_values(), b.packed_values()));
  EXPECT_TRUE(at::equal(a.packed_positions(), b.packed_positions()));
  EXPECT_TRUE(at::equal(a.offsets(), b.offsets()));
  EXPECT_EQ(a.next_position(), 50);
  EXPECT_TRUE(at::equal(a.keep_mask(), mask));
  EXPECT_TRUE(at::equal(a.lengths(), mask.sum(2)));
  EXPECT_EQ(a.min_length(), 0);  // the last head keeps nothing
  EXPECT_EQ(a.max_length(), 50);
  EXPECT_EQ(a.total_tokens(), mask.sum().item<int64_t>());
  for (int64_t bi = 0; bi < 2; ++bi) {
    for (int64_t h = 0; h < 3; ++h) {
      EXPECT_TRUE(at::equal(a.keys(bi, h), kv.at(bi, h).keys));
      EXPECT_TRUE(at::equal(a.values(bi, h), kv.at(bi, h).values));
      EXPECT_TRUE(at::equal(a.kept_indices(bi, h), kv.at(bi, h).kept_indices));
    }
  }
  // Explicit seq_len: appended tokens continue from there.
  EXPECT_EQ(HeadRaggedLayer::from_ragged(kv, 64).next_position(), 64);
}

TEST(HeadRaggedLayer, BytesAreTheKeptTokensPlusIndex) {
  const int64_t batch = 1, kv_heads = 4, seq_len = 256, dim = 32;
  const at::Tensor keys = testing::randn({batch, kv_heads, seq_len, dim}, 15);
  const at::Tensor values = testing::randn({batch, kv_heads, seq_len, dim}, 16);
  const at::Tensor mask = uneven_mask(batch, kv_heads, seq_len, 17);
  HeadRaggedLayer layer = HeadRaggedLayer::from_mask(keys, values, mask);
  const int64_t kept = mask.sum().item<int64_t>();
  EXPECT_EQ(layer.packed_tokens(), kept);
  EXPECT_EQ(layer.storage_bytes(), 2 * kept * dim * 4);
  // int64 position per kept token + offsets on the device and the host.
  EXPECT_EQ(layer.index_bytes(), kept * 8 + 2 * (batch * kv_heads + 1) * 8);
  EXPECT_EQ(layer.bytes(), layer.storage_bytes() + layer.index_bytes());

  // Appending grows only the tail, geometrically; shrink_to_fit trims it back.
  for (int i = 0; i < 5; ++i) layer.append(keys.narrow(2, 0, 1), values.narrow(2, 0, 1));
  EXPECT_EQ(layer.storage_bytes(), 2 * kept * dim * 4 + 2 * batch * kv_heads * 8 * dim * 4);  // capacity 8
  layer.shrink_to_fit();
  EXPECT_EQ(layer.storage_bytes(), 2 * (kept + batch * kv_heads * 5) * dim * 4);
  EXPECT_EQ(layer.total_tokens(), kept + batch * kv_heads * 5);

  HeadRaggedCache cache(3);
  cache.set_layer(1, layer);
  EXPECT_EQ(cache.bytes(), layer.bytes());
  EXPECT_FALSE(cache.layer(0).defined());
}

TEST(HeadRaggedLayer, AppendTruncateAndRoundTrip) {
  const at::Tensor keys = testing::randn({1, 2, 30, 8}, 18), values = testing::randn({1, 2, 30, 8}, 19);
  const at::Tensor mask = uneven_mask(1, 2, 20, 20);
  HeadRaggedLayer layer = HeadRaggedLayer::from_mask(keys.narrow(2, 0, 20), values.narrow(2, 0, 20), mask);
  layer.append(keys.narrow(2, 20, 6), values.narrow(2, 20, 6));
  layer.append(keys.narrow(2, 26, 4), values.narrow(2, 26, 4));
  EXPECT_EQ(layer.appended(), 10);
  EXPECT_EQ(layer.length(0, 1), mask[0][1].sum().item<int64_t>() + 10);
  // Head contents: kept past then every appended token, in position order.
  const at::Tensor idx = layer.kept_indices(0, 1);
  const at::Tensor expected_idx = at::cat({mask[0][1].nonzero().view(-1), at::arange(20, 30, at::kLong)});
  EXPECT_TRUE(at::equal(idx, expected_idx));
  EXPECT_TRUE(at::equal(layer.keys(0, 1), keys[0][1].index_select(0, expected_idx)));
  EXPECT_TRUE(at::equal(layer.values(0, 1), values[0][1].index_select(0, expected_idx)));
  const at::Tensor full_mask = at::cat({mask, at::ones({1, 2, 10}, at::kBool)}, 2);
  EXPECT_TRUE(at::equal(layer.keep_mask(), full_mask));
  const HeadRaggedLayer copy = HeadRaggedLayer::from_ragged(layer.to_ragged());
  EXPECT_TRUE(at::equal(copy.keep_mask(), full_mask));

  // Drop the last 7 appended tokens (e.g. an answer) and continue from position 23.
  layer.truncate_appended(3, 23);
  EXPECT_EQ(layer.appended(), 3);
  EXPECT_EQ(layer.next_position(), 23);
  EXPECT_TRUE(at::equal(layer.tail_keys(), keys.narrow(2, 20, 3)));
  layer.append(keys.narrow(2, 23, 1), values.narrow(2, 23, 1));
  EXPECT_EQ(layer.tail_positions(), (std::vector<int64_t>{20, 21, 22, 23}));
}

TEST(RaggedAttention, Errors) {
  const at::Tensor keys = testing::randn({1, 2, 10, 8}, 1), values = testing::randn({1, 2, 10, 8}, 2);
  HeadRaggedLayer layer = HeadRaggedLayer::from_dense(keys, values);
  const at::Tensor q = testing::randn({1, 4, 1, 8}, 3);
  // Nothing appended yet: the queries must belong to appended tokens.
  expect_error([&] { ops::ragged_attention(q, layer); },
               {"ragged_attention: the queries must be those of the last n tail tokens", "got 1"});
  layer.append(keys.narrow(2, 0, 1), values.narrow(2, 0, 1));
  expect_error(
      [&] {
        ops::ragged_attention(q.view({4, 1, 8}), layer);
      },
      {"ragged_attention: queries must be [batch, q_heads, n, head_dim], got [4, 1, 8]"});
  expect_error([&] { ops::ragged_attention(q.to(at::kHalf), layer); },
               {"ragged_attention: packed_keys must have the dtype of queries (Half), got Float"});
  expect_error([&] { ops::ragged_attention(q.to(at::kInt), layer); },
               {"ragged_attention: queries must be float32, float16 or bfloat16, got Int"});
  expect_error(
      [&] {
        ops::ragged_attention(testing::randn({1, 3, 1, 8}, 4), layer);
      },
      {"num_heads must be a positive multiple of num_kv_heads (2), got 3"});
  expect_error(
      [&] {
        ops::ragged_attention(testing::randn({1, 4, 1, 16}, 4), layer);
      },
      {"ragged_attention: tail_keys must be [1, kv_heads, m, 16] like queries, got [1, 2, 1, 8]"});
  expect_error([&] { ops::ragged_attention(testing::randn({2, 4, 1, 8}, 4), layer); }, {"tail_keys must be [2, "});
  expect_error([&] { ops::ragged_attention(q, layer, -1.0); },
               {"ragged_attention: scale must be a finite positive number, got -1"});

  const at::Tensor pk = layer.packed_keys(), pv = layer.packed_values();
  const at::Tensor tk = layer.tail_keys(), tv = layer.tail_values();
  expect_error(
      [&] {
        ops::ragged_attention(q, pk, pv, at::tensor({0, 10}, at::kLong), tk, tv);
      },
      {"ragged_attention: offsets must be [batch * kv_heads + 1] = [3], got [2]"});
  expect_error(
      [&] {
        ops::ragged_attention(q, pk, pv, at::tensor({0, 12, 10}, at::kLong), tk, tv);
      },
      {"offsets must be non-decreasing, got offsets[1] = 12 > offsets[2] = 10"});
  expect_error(
      [&] {
        ops::ragged_attention(q, pk, pv, at::tensor({0, 10, 19}, at::kLong), tk, tv);
      },
      {"offsets[2] must equal the packed token count 20, got 19"});
  expect_error(
      [&] {
        ops::ragged_attention(q, pk, pv, at::tensor({1, 10, 20}, at::kLong), tk, tv);
      },
      {"offsets[0] must be 0, got 1"});
  expect_error(
      [&] {
        ops::ragged_attention(q, pk, pv, at::tensor({0, 10, 20}, at::kInt), tk, tv);
      },
      {"ragged_attention: offsets must be int64, got Int"});
  expect_error([&] { ops::ragged_attention(q, pk, pv.narrow(0, 0, 19), layer.offsets(), tk, tv); },
               {"packed_values must have the shape of packed_keys [20, 8], got [19, 8]"});
  expect_error([&] { ops::ragged_attention(q, pk, pv, layer.offsets(), tk, at::Tensor()); },
               {"ragged_attention: tail_values is required but was not given"});
  expect_error([&] { ops::ragged_attention(q, HeadRaggedLayer()); }, {"ragged_attention: layer is empty"});
}

TEST(HeadRaggedLayer, Errors) {
  const at::Tensor keys = testing::randn({1, 2, 10, 8}, 1), values = testing::randn({1, 2, 10, 8}, 2);
  const at::Tensor mask = at::ones({1, 2, 10}, at::kBool);
  expect_error([&] { HeadRaggedLayer::from_mask(keys, values, mask.to(at::kInt)); },
               {"HeadRaggedLayer::from_mask: keep_mask must be bool, got Int"});
  expect_error([&] { HeadRaggedLayer::from_mask(keys, values, mask.narrow(2, 0, 9)); },
               {"HeadRaggedLayer::from_mask: keep_mask must be [1, 2, 10], got [1, 2, 9]"});
  expect_error([&] { HeadRaggedLayer::from_dense(keys[0], values[0]); },
               {"HeadRaggedLayer::from_dense: keys must be [batch, kv_heads, seq_len, head_dim], got [2, 10, 8]"});

  RaggedKV kv = ops::gather_ragged(keys, values, mask);
  RaggedKV short_kv = kv;
  short_kv.heads.pop_back();
  expect_error([&] { HeadRaggedLayer::from_ragged(short_kv); },
               {"HeadRaggedLayer::from_ragged: heads must hold batch * kv_heads = 2 entries, got 1"});
  RaggedKV unsorted = kv;
  unsorted.heads[1].kept_indices = unsorted.heads[1].kept_indices.flip(0);
  expect_error([&] { HeadRaggedLayer::from_ragged(unsorted); },
               {"kept_indices must be strictly ascending within each head"});
  RaggedKV bad_dim = kv;
  bad_dim.heads[1].keys = bad_dim.heads[1].keys.narrow(1, 0, 4);
  expect_error([&] { HeadRaggedLayer::from_ragged(bad_dim); },
               {"HeadRaggedLayer::from_ragged: heads[1].keys must be [n_kept, 8], got [10, 4]"});
  RaggedKV bad_dtype = kv;
  bad_dtype.heads[1].values = bad_dtype.heads[1].values.to(at::kHalf);
  expect_error([&] { HeadRaggedLayer::from_ragged(bad_dtype); },
               {"heads[1] keys and values must be Float like heads[0]"});
  expect_error([&] { HeadRaggedLayer::from_ragged(kv, 5); },
               {"seq_len must be greater than every kept index (9), got 5"});

  HeadRaggedLayer layer = HeadRaggedLayer::from_dense(keys, values);
  expect_error([&] { layer.append(keys.narrow(1, 0, 1), values.narrow(1, 0, 1)); },
               {"HeadRaggedLayer::append: keys must be [1, 2, n, 8], got [1, 1, 10, 8]"});
  expect_error([&] { layer.append(keys.to(at::kHalf), values.to(at::kHalf)); },
               {"HeadRaggedLayer::append: keys must be Float like the layer, got Half"});
  expect_error([&] { layer.truncate_appended(1, 11); },
               {"HeadRaggedLayer::truncate_appended: n_keep must be in [0, 0], got 1"});
  expect_error([&] { layer.truncate_appended(0, 9); },
               {"next_position must be greater than the last position kept (9), got 9"});
  expect_error([&] { HeadRaggedLayer().append(keys, values); }, {"HeadRaggedLayer::append: the layer is empty"});
  expect_error([&] { layer.length(0, 2); }, {"HeadRaggedLayer: head (0, 2) out of range for batch 1 and kv_heads 2"});
}

// CPU vs CUDA parity; skipped where no GPU is present (as tests/test_cuda.cpp).
TEST(CudaParity, RaggedAttention) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (int64_t n_new : {1, 5}) {
      const int64_t batch = 2, kv_heads = 4, q_heads = 16, seq_len = 700, dim = 128;
      const at::Tensor keys = testing::randn({batch, kv_heads, seq_len + n_new, dim}, 40, dtype);
      const at::Tensor values = testing::randn({batch, kv_heads, seq_len + n_new, dim}, 41, dtype);
      const at::Tensor q = testing::randn({batch, q_heads, n_new, dim}, 42, dtype);
      const at::Tensor mask = uneven_mask(batch, kv_heads, seq_len, 43);
      HeadRaggedLayer cpu = HeadRaggedLayer::from_mask(keys.narrow(2, 0, seq_len), values.narrow(2, 0, seq_len), mask);
      cpu.append(keys.narrow(2, seq_len, n_new), values.narrow(2, seq_len, n_new));
      HeadRaggedLayer gpu = HeadRaggedLayer::from_mask(keys.narrow(2, 0, seq_len).cuda(),
                                                       values.narrow(2, 0, seq_len).cuda(), mask.cuda());
      gpu.append(keys.narrow(2, seq_len, n_new).cuda(), values.narrow(2, seq_len, n_new).cuda());
      const at::Tensor a = ops::ragged_attention(q, cpu).to(at::kFloat);
      const at::Tensor b = ops::ragged_attention(q.cuda(), gpu).cpu().to(at::kFloat);
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
      EXPECT_TRUE(at::allclose(a, b, tol, tol))
          << dtype << " n=" << n_new << " max diff " << (a - b).abs().max().item<double>();
      const at::Tensor ref = masked_dense_attention(q, keys, values, mask, 1.0 / std::sqrt(128.0)).to(at::kFloat);
      EXPECT_TRUE(at::allclose(b, ref, tol * 2, tol * 2)) << dtype << " n=" << n_new;
    }
  }
}

}  // namespace
}  // namespace kvpress
