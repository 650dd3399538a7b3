// 64-bit offsets (issue 12, item 5): the CPU kernels on a cache of more than 2^31 elements, where
// every element offset past 2^31 would wrap in 32-bit arithmetic. One ctest entry
// (large.indices_beyond_2_31), run alone: it needs about 15 GiB.
//
// Row r of the cache is bank[hash(r)] for a small random bank, so the expected result of every row
// is known without a second copy of the cache: a wrapped offset would read another row.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "kvpress/kvpress.h"

namespace kvpress {
namespace {

constexpr int64_t kSeq = (int64_t{1} << 24) + (int64_t{1} << 20);  // 17.8M positions
constexpr int64_t kDim = 128;                                      // 2.28e9 elements per tensor
constexpr int64_t kBank = 65521;                                   // a prime

// hash(r) = r * 7919 mod kBank, as int64 [n].
at::Tensor bank_rows(const at::Tensor& positions) { return (positions * 7919).remainder(kBank); }

struct LargeCache {
  at::Tensor bank_keys, bank_values;  // [kBank, D] bfloat16
  at::Tensor keys, values;            // [1, 1, kSeq, D] bfloat16, row r = bank[hash(r)]
};

const LargeCache& large_cache() {
  static const LargeCache cache = [] {
    at::manual_seed(7);
    LargeCache c;
    c.bank_keys = at::randn({kBank, kDim}).to(at::kBFloat16);
    c.bank_values = at::randn({kBank, kDim}).to(at::kBFloat16);
    const at::Tensor rows = bank_rows(at::arange(kSeq, at::kLong));
    c.keys = c.bank_keys.index_select(0, rows).view({1, 1, kSeq, kDim});
    c.values = c.bank_values.index_select(0, rows).view({1, 1, kSeq, kDim});
    return c;
  }();
  return cache;
}

TEST(LargeIndices, CacheHasMoreElementsThanInt32Offsets) { EXPECT_GT(large_cache().keys.numel(), int64_t{1} << 31); }

TEST(LargeIndices, KeyNormAndTopkAndGatherReadEveryRow) {
  const LargeCache& c = large_cache();
  const at::Tensor positions = at::arange(kSeq, at::kLong);
  // Key norms: every row's score is its bank row's.
  const at::Tensor scores = ops::key_norm_scores(c.keys).flatten();
  const at::Tensor bank_scores = -at::linalg_vector_norm(c.bank_keys.to(at::kFloat), 2, {-1});
  EXPECT_TRUE(at::allclose(scores, bank_scores.index_select(0, bank_rows(positions)), 1e-5, 1e-5));
  // A whole press: top-k over 17.8M scores, then the gather of 8.9M rows past the 2^31st element.
  LayerInputs in;
  in.keys = c.keys;
  in.values = c.values;
  const KV kv = KnormPress(0.5).compress(in);
  const at::Tensor kept = kv.kept_indices.flatten();
  ASSERT_EQ(kept.numel(), ops::n_kept(kSeq, 0.5));
  EXPECT_TRUE((kept.narrow(0, 1, kept.numel() - 1) > kept.narrow(0, 0, kept.numel() - 1)).all().item<bool>());
  EXPECT_GT(kept.max().item<int64_t>(), (int64_t{1} << 31) / kDim);  // kept rows beyond the 2^31st element
  const at::Tensor expected_rows = bank_rows(kept);
  EXPECT_TRUE(at::equal(kv.keys.view({-1, kDim}), c.bank_keys.index_select(0, expected_rows)));
  EXPECT_TRUE(at::equal(kv.values.view({-1, kDim}), c.bank_values.index_select(0, expected_rows)));
}

TEST(LargeIndices, KeyDiffReadsEveryRow) {
  const LargeCache& c = large_cache();
  const at::Tensor scores = ops::keydiff_scores(c.keys).flatten();
  // -cos(k_r, anchor): the anchor is the mean of the unit rows, computed from the bank's counts.
  const at::Tensor bank = c.bank_keys.to(at::kDouble);
  const at::Tensor unit = bank / bank.norm(2, -1, true).clamp_min(1e-12);
  const at::Tensor counts = at::bincount(bank_rows(at::arange(kSeq, at::kLong)), {}, kBank).to(at::kDouble);
  const at::Tensor anchor = (unit * counts.unsqueeze(1)).sum(0) / static_cast<double>(kSeq);
  const at::Tensor bank_scores = -at::cosine_similarity(bank, anchor.unsqueeze(0), -1, 1e-8).to(at::kFloat);
  const at::Tensor expected = bank_scores.index_select(0, bank_rows(at::arange(kSeq, at::kLong)));
  EXPECT_TRUE(at::allclose(scores, expected, 1e-3, 1e-4)) << (scores - expected).abs().max().item<double>();
}

TEST(LargeIndices, LagKVPartitionsPastTheInt32Range) {
  const LargeCache& c = large_cache();
  const int64_t lag = 128, sinks = 4;
  const at::Tensor scores = ops::lagkv_scores(c.keys, c.values, sinks, lag, /*cross_scoring=*/true).flatten();
  // A partition's statistics depend on it and the next one only: compare the last scored partitions
  // with the same partitions scored alone.
  const int64_t parts = (kSeq - sinks) / lag;
  for (int64_t p : {parts - 2, parts - 3, parts / 2}) {
    const int64_t begin = sinks + p * lag;
    const at::Tensor alone = ops::lagkv_scores(c.keys.narrow(2, begin, 2 * lag).contiguous(),
                                               c.values.narrow(2, begin, 2 * lag).contiguous(), 0, lag, true);
    EXPECT_TRUE(at::allclose(scores.narrow(0, begin, lag), alone.flatten().narrow(0, 0, lag), 1e-5, 1e-7)) << p;
  }
}

TEST(LargeIndices, RaggedAttentionOverAHeadPastTheInt32Range) {
  const LargeCache& c = large_cache();
  // One head holding every position packed: [kSeq, D] rows, offsets [0, kSeq].
  const at::Tensor packed_keys = c.keys.view({kSeq, kDim}), packed_values = c.values.view({kSeq, kDim});
  const at::Tensor offsets = at::tensor({int64_t{0}, kSeq}, at::kLong);
  at::manual_seed(8);
  const at::Tensor q = at::randn({1, 2, 1, kDim}).to(at::kBFloat16);
  const at::Tensor tail = at::randn({1, 1, 1, kDim}).to(at::kBFloat16);
  const at::Tensor out = ops::ragged_attention(q, packed_keys, packed_values, offsets, tail, tail).to(at::kFloat);
  // Reference from the bank: softmax over positions = softmax over bank rows weighted by their counts.
  const at::Tensor counts = at::bincount(bank_rows(at::arange(kSeq, at::kLong)), {}, kBank).to(at::kDouble);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  for (int64_t h = 0; h < 2; ++h) {
    const at::Tensor qh = q[0][h][0].to(at::kDouble);
    const at::Tensor bank_logits = at::matmul(c.bank_keys.to(at::kDouble), qh) * scale;
    const at::Tensor tail_logit = (tail[0][0][0].to(at::kDouble) * qh).sum() * scale;
    const double top = std::max(bank_logits.max().item<double>(), tail_logit.item<double>());
    const at::Tensor w = (bank_logits - top).exp() * counts;
    const at::Tensor wt = (tail_logit - top).exp();
    const at::Tensor expected =
        (at::matmul(w, c.bank_values.to(at::kDouble)) + wt * tail[0][0][0].to(at::kDouble)) / (w.sum() + wt);
    EXPECT_TRUE(at::allclose(out[0][h][0], expected.to(at::kFloat), 2e-2, 2e-3)) << h;
  }
}

}  // namespace
}  // namespace kvpress
