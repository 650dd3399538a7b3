// PagedKVCache with quantized pages (PagedCacheOptions::kv_format): which rows are quantized and
// when, the memory it takes, and that every mutation (store, append, remove_last, compact, adopt)
// leaves each head holding what the format's definition says. The expected rows are built from the
// original rows with ops::kv_quantize page by page, so the comparisons are exact (float32 caches):
// the cache must quantize the same pages of the same rows.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvpress/kvpress.h"
#include "paged/fault_injection.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;

constexpr std::array<KVFormat, 3> kFormats{KVFormat::kInt8, KVFormat::kFp8, KVFormat::kInt4};

PagedCacheOptions options(KVFormat format, int64_t pages = 64, at::ScalarType dtype = at::kFloat) {
  PagedCacheOptions o;
  o.num_layers = 2;
  o.kv_heads = 2;
  o.head_dim = 16;
  o.pages_per_layer = pages;
  o.page_size = 4;
  o.dtype = dtype;
  o.kv_format = format;
  return o;
}

// What a head of the format holds for `rows` [L, D] stored in order: its full pages quantized and
// read back, the rest as they are.
at::Tensor as_stored(const at::Tensor& rows, KVFormat format, KVRole role, int64_t page_size) {
  const int64_t full = rows.size(0) / page_size * page_size;
  if (full == 0) return rows;
  const auto [codes, scales] =
      ops::kv_quantize(rows.narrow(0, 0, full).view({-1, page_size, rows.size(1)}), format, role);
  const at::Tensor read = ops::kv_dequantize(codes, scales, format, role, rows.size(1)).view({full, rows.size(1)});
  return at::cat({read.to(rows.scalar_type()), rows.narrow(0, full, rows.size(0) - full)});
}

// Causal attention of each sequence's last n tokens over its heads' rows (head_keys/head_values),
// float64: what the kernel computes from the rows the cache holds.
at::Tensor attention_over_rows(const PagedKVCache& cache, int64_t layer, const std::vector<SequenceId>& seqs,
                               const at::Tensor& queries) {
  const int64_t hkv = cache.options().kv_heads;
  std::vector<at::Tensor> keys, values;  // [B * Hkv] x [L, D]
  for (SequenceId seq : seqs)
    for (int64_t h = 0; h < hkv; ++h) {
      keys.push_back(cache.head_keys(seq, layer, h));
      values.push_back(cache.head_values(seq, layer, h));
    }
  return testing::reference_attention(queries, keys, values, hkv);
}

TEST(QuantizedPagedCache, StoresFullPagesQuantizedAndTheRestInItsDtype) {
  for (KVFormat format : kFormats) {
    PagedKVCache cache(options(format));
    const std::vector<int64_t> lengths{11, 4, 3};  // two pages and 3 residual rows; one page; residual only
    const at::Tensor keys = testing::randn({18, 2, 16}, 1), values = testing::randn({18, 2, 16}, 2);
    const at::Tensor cu = at::tensor({int64_t{0}, int64_t{11}, int64_t{15}, int64_t{18}});
    const std::vector<SequenceId> seqs{cache.add_sequence(), cache.add_sequence(), cache.add_sequence()};
    cache.store(0, seqs, keys, values, cu);
    int64_t pages = 0;
    for (size_t i = 0; i < seqs.size(); ++i)
      for (int64_t h = 0; h < 2; ++h) {
        const at::Tensor k = keys.narrow(0, cu[static_cast<int64_t>(i)].item<int64_t>(), lengths[i]).select(1, h);
        const at::Tensor v = values.narrow(0, cu[static_cast<int64_t>(i)].item<int64_t>(), lengths[i]).select(1, h);
        EXPECT_TRUE(at::equal(cache.head_keys(seqs[i], 0, h), as_stored(k, format, KVRole::kKeys, 4)))
            << kv_format_name(format) << " sequence " << i << " head " << h;
        EXPECT_TRUE(at::equal(cache.head_values(seqs[i], 0, h), as_stored(v, format, KVRole::kValues, 4)));
        EXPECT_EQ(static_cast<int64_t>(cache.pages(seqs[i], 0, h).size()), lengths[i] / 4);
        pages += lengths[i] / 4;
      }
    // Memory: the pages in use at the format's bytes (codes and scales), nothing else per token but the
    // residual rows, a page per (slot, layer, head) in the cache's dtype.
    const PagedCacheStats s = cache.stats();
    const int64_t page_bytes = kv_page_layout(format, KVRole::kKeys, 4, 16, at::kFloat).bytes_per_page(4) +
                               kv_page_layout(format, KVRole::kValues, 4, 16, at::kFloat).bytes_per_page(4);
    EXPECT_EQ(s.pages_used, pages);
    EXPECT_EQ(s.bytes_per_page, page_bytes);
    EXPECT_EQ(s.bytes_used(), pages * page_bytes);
    EXPECT_EQ(s.residual_bytes, 2 * 2 * 8 * 2 * 4 * 16 * 4);  // K+V, layers, 8 slots, heads, page, D, float32
    EXPECT_EQ(s.tokens, 2 * (11 + 4 + 3));
    const at::Tensor q = testing::randn({3, 4, 1, 16}, 3);
    EXPECT_TRUE(
        at::allclose(cache.attention(0, seqs, q).to(at::kDouble), attention_over_rows(cache, 0, seqs, q), 1e-5, 1e-5));
  }
}

// Appending one token at a time: a page is quantized when it fills, from the rows as they came.
TEST(QuantizedPagedCache, AppendsQuantizeAPageWhenItFills) {
  for (KVFormat format : kFormats) {
    PagedKVCache cache(options(format));
    const at::Tensor keys = testing::randn({1, 2, 16, 16}, 4), values = testing::randn({1, 2, 16, 16}, 5);
    const SequenceId seq = cache.add_sequence();
    cache.store_padded(1, {seq}, keys.narrow(2, 0, 3), values.narrow(2, 0, 3), at::tensor({int64_t{3}}));
    for (int64_t t = 3; t < 16; ++t) {
      cache.append(1, {seq}, keys.narrow(2, t, 1), values.narrow(2, t, 1));
      for (int64_t h = 0; h < 2; ++h) {
        EXPECT_TRUE(
            at::equal(cache.head_keys(seq, 1, h), as_stored(keys[0][h].narrow(0, 0, t + 1), format, KVRole::kKeys, 4)))
            << kv_format_name(format) << " after token " << t;
        EXPECT_TRUE(at::equal(cache.head_values(seq, 1, h),
                              as_stored(values[0][h].narrow(0, 0, t + 1), format, KVRole::kValues, 4)));
      }
      EXPECT_EQ(cache.pages_to_append(1, {seq}, 1), (t + 2) % 4 == 0 ? 2 : 0);  // a page per head when one fills
      const at::Tensor q = testing::randn({1, 6, 1, 16}, 6 + static_cast<uint64_t>(t));
      EXPECT_TRUE(at::allclose(cache.attention(1, {seq}, q).to(at::kDouble), attention_over_rows(cache, 1, {seq}, q),
                               1e-5, 1e-5));
    }
  }
}

// The formats' errors, through a whole attention: a bfloat16 cache against a full one.
TEST(QuantizedPagedCache, AttentionStaysNearTheFullPrecisionCache) {
  const at::Tensor keys = testing::randn({64, 2, 16}, 7, at::kBFloat16);
  const at::Tensor values = testing::randn({64, 2, 16}, 8, at::kBFloat16);
  const at::Tensor cu = at::tensor({int64_t{0}, int64_t{64}});
  const at::Tensor q = testing::randn({1, 4, 1, 16}, 9, at::kBFloat16);
  PagedKVCache full(options(KVFormat::kFull, 64, at::kBFloat16));
  const SequenceId f = full.add_sequence();
  full.store(0, {f}, keys, values, cu);
  const at::Tensor reference = full.attention(0, {f}, q).to(at::kFloat);
  // Values of standard deviation 1: an attention output mixes them, so its error is about the
  // values' quantization error (half a step: 1/254 of the page maximum for int8, 2^-4 relative for
  // fp8, 1/30 of a token's range for int4) plus what the keys' errors move the weights.
  for (const auto& [format, bound] :
       {std::pair<KVFormat, double>{KVFormat::kInt8, 0.05}, {KVFormat::kFp8, 0.1}, {KVFormat::kInt4, 0.4}}) {
    PagedKVCache cache(options(format, 64, at::kBFloat16));
    const SequenceId s = cache.add_sequence();
    cache.store(0, {s}, keys, values, cu);
    const double error = (cache.attention(0, {s}, q).to(at::kFloat) - reference).abs().max().item<double>();
    EXPECT_LT(error, bound) << kv_format_name(format);
    EXPECT_GT(error, 0.0) << kv_format_name(format) << ": quantized pages read exactly as full ones";
  }
}

TEST(QuantizedPagedCache, RemoveLastReopensAFilledPageDequantized) {
  for (KVFormat format : kFormats) {
    PagedKVCache cache(options(format));
    const at::Tensor keys = testing::randn({1, 2, 10, 16}, 10), values = testing::randn({1, 2, 10, 16}, 11);
    const SequenceId seq = cache.add_sequence();
    cache.store_padded(0, {seq}, keys.narrow(2, 0, 7), values.narrow(2, 0, 7), at::tensor({int64_t{7}}));
    const int64_t free_before = cache.free_pages(0);
    cache.append(0, {seq}, keys.narrow(2, 7, 3), values.narrow(2, 7, 3));  // fills page 2, one residual row
    const at::Tensor rows_after_append = cache.head_keys(seq, 0, 1);
    cache.remove_last(0, {seq}, 3);
    EXPECT_EQ(cache.free_pages(0), free_before);
    EXPECT_EQ(cache.pages(seq, 0, 1).size(), 1u);
    EXPECT_EQ(cache.next_position(seq, 0), 7);
    // Rows 4 .. 6 come back from the page they were quantized into.
    EXPECT_TRUE(at::equal(cache.head_keys(seq, 0, 1), rows_after_append.narrow(0, 0, 7))) << kv_format_name(format);
    const at::Tensor q = testing::randn({1, 2, 1, 16}, 12);
    EXPECT_TRUE(at::allclose(cache.attention(0, {seq}, q).to(at::kDouble), attention_over_rows(cache, 0, {seq}, q),
                             1e-5, 1e-5));
  }
}

// Kept rows move forward; the pages before the first moved row keep their codes, the others are
// quantized again from their new rows (read back from the cache), the tail is residual rows.
TEST(QuantizedPagedCache, CompactQuantizesAgainOnlyThePagesWhoseRowsChange) {
  for (KVFormat format : kFormats) {
    PagedKVCache cache(options(format));
    const at::Tensor keys = testing::randn({1, 2, 19, 16}, 13), values = testing::randn({1, 2, 19, 16}, 14);
    const SequenceId seq = cache.add_sequence();
    cache.store_padded(0, {seq}, keys, values, at::tensor({int64_t{19}}));
    const QuantizedPagePool pool = cache.quantized_pool(0);
    const int64_t first_page = cache.pages(seq, 0, 0).front();
    const at::Tensor page0_codes = pool.key_codes[first_page].clone();
    std::vector<at::Tensor> before{cache.head_keys(seq, 0, 0), cache.head_keys(seq, 0, 1)};
    at::Tensor keep = at::ones({2, 19}, at::kBool);
    keep[0].narrow(0, 5, 6).fill_(false);  // head 0: drops rows 5 .. 10 (13 kept: 3 pages, 1 residual row)
    keep[1][18] = false;                   // head 1: drops its last (residual) row only
    const int64_t free_before = cache.free_pages(0);
    cache.compact(0, seq, keep);
    EXPECT_EQ(cache.free_pages(0), free_before + 1);  // head 0: 4 full pages -> 3
    const at::Tensor kept0 = before[0].index_select(0, at::nonzero(keep[0]).view(-1));
    const at::Tensor expected0 =
        at::cat({kept0.narrow(0, 0, 4), as_stored(kept0.narrow(0, 4, 9), format, KVRole::kKeys, 4)});
    EXPECT_TRUE(at::equal(cache.head_keys(seq, 0, 0), expected0)) << kv_format_name(format);
    EXPECT_TRUE(at::equal(cache.quantized_pool(0).key_codes[first_page], page0_codes));
    EXPECT_TRUE(at::equal(cache.head_keys(seq, 0, 1), before[1].narrow(0, 0, 18)));
    const at::Tensor q = testing::randn({1, 2, 1, 16}, 15);
    EXPECT_TRUE(at::allclose(cache.attention(0, {seq}, q).to(at::kDouble), attention_over_rows(cache, 0, {seq}, q),
                             1e-5, 1e-5));
  }
}

// Exported rows are the dequantized ones; adopting them into a cache of the same format and page
// size quantizes each page again to its codes (the scale within a rounding of itself).
TEST(QuantizedPagedCache, AnAdoptedSequenceHoldsTheExportedRows) {
  for (KVFormat format : kFormats) {
    PagedKVCache source(options(format)), target(options(format, 32));
    const SequenceId seq = source.add_sequence();
    for (int64_t layer = 0; layer < 2; ++layer)
      source.store_padded(layer, {seq}, testing::randn({1, 2, 13, 16}, 16 + static_cast<uint64_t>(layer)),
                          testing::randn({1, 2, 13, 16}, 18 + static_cast<uint64_t>(layer)), at::tensor({int64_t{13}}));
    const SequenceId adopted = target.adopt_sequence(source.export_sequence(seq));
    for (int64_t layer = 0; layer < 2; ++layer)
      for (int64_t h = 0; h < 2; ++h) {
        EXPECT_TRUE(at::allclose(target.head_keys(adopted, layer, h), source.head_keys(seq, layer, h), 1e-6, 1e-6))
            << kv_format_name(format);
        EXPECT_TRUE(at::allclose(target.head_values(adopted, layer, h), source.head_values(seq, layer, h), 1e-6, 1e-6));
      }
  }
}

TEST(QuantizedPagedCache, AFailedAppendLeavesEveryRowAsItWas) {
  PagedKVCache cache(options(KVFormat::kInt8));
  const SequenceId seq = cache.add_sequence();
  cache.store_padded(0, {seq}, testing::randn({1, 2, 7, 16}, 20), testing::randn({1, 2, 7, 16}, 21),
                     at::tensor({int64_t{7}}));
  const at::Tensor keys = cache.head_keys(seq, 0, 0);
  const int64_t free_pages = cache.free_pages(0);
  // The append fills page 2 with the 3 residual rows and writes 2 rows over them: a table upload
  // that fails before that must leave the residual rows untouched.
  detail::inject_failure_after(0, detail::FaultPoint::kTableUpload);
  expect_error(
      [&] {
        cache.append(0, {seq}, testing::randn({1, 2, 3, 16}, 22), testing::randn({1, 2, 3, 16}, 23));
      },
      {"injected failure of a device-table upload"});
  EXPECT_TRUE(at::equal(cache.head_keys(seq, 0, 0), keys));
  EXPECT_EQ(cache.free_pages(0), free_pages);
  EXPECT_EQ(cache.length(seq, 0, 0), 7);
}

TEST(QuantizedPagedCache, PoolsAreReachedThroughTheirFormsAccessor) {
  PagedKVCache quantized(options(KVFormat::kFp8)), full(options(KVFormat::kFull));
  expect_error([&] { quantized.key_pool(0); },
               {"PagedKVCache::key_pool: the cache stores fp8 pages; quantized_pool() gives their codes"});
  expect_error([&] { full.quantized_pool(0); },
               {"PagedKVCache::quantized_pool: the cache stores full pages (KVFormat::kFull)"});
  EXPECT_EQ(quantized.quantized_pool(1).key_codes.sizes(), at::IntArrayRef({64, 4, 16}));
  PagedCacheOptions odd = options(KVFormat::kInt4);
  odd.head_dim = 15;
  expect_error([&] { PagedKVCache cache(odd); },
               {"PagedKVCache: int4 packs two channels per byte, so head_dim must be even, got 15"});
}

}  // namespace
}  // namespace kvpress
