// The paged KV cache (issue 13): ops::paged_attention / paged_write against dense references, and
// PagedKVCache's store (compress while storing, every prefill press), append, attention, compact,
// statistics and all-or-nothing errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if KVPRESS_TESTS_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#endif

#include "compactor/compactor.h"
#include "fault_sweep.h"
#include "kvpress/kvpress.h"
#include "kvpress/paged.h"
#include "paged/paged.h"
#include "ragged_attention/ragged_attention.h"
#include "random_inputs.h"
#include "rope_heads/rope_heads.h"
#include "runnable_press.h"
#include "scores/scores.h"
#include "selection/selection.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::expect_error;
using testing::randn;
using testing::reference_attention;

// Per-head token lists laid out in randomly ordered pages of a pool.
struct PagedLayout {
  at::Tensor key_pool, value_pool;       // [P, page_size, D]
  at::Tensor page_table, lengths;        // [B, Hkv, max_pages], [B, Hkv]
  std::vector<at::Tensor> keys, values;  // per head (b * Hkv + h): [L, D]
};

PagedLayout random_layout(int64_t batch, int64_t kv_heads, const std::vector<int64_t>& lengths, int64_t page_size,
                          int64_t dim, at::ScalarType dtype, uint64_t seed) {
  int64_t pages_needed = 0, max_pages = 1;
  for (int64_t l : lengths) {
    pages_needed += (l + page_size - 1) / page_size;
    max_pages = std::max(max_pages, (l + page_size - 1) / page_size);
  }
  const int64_t num_pages = pages_needed + 3;  // a few pages nobody uses
  PagedLayout out;
  out.key_pool = randn({num_pages, page_size, dim}, seed, dtype);
  out.value_pool = randn({num_pages, page_size, dim}, seed + 1, dtype);
  std::vector<int64_t> order(static_cast<size_t>(num_pages));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(seed)));
  // Unused table entries hold a wild value: the kernels must never read them.
  out.page_table = at::full({batch, kv_heads, max_pages}, 1 << 30, at::kLong);
  out.lengths = at::tensor(at::ArrayRef<int64_t>(lengths), at::kLong).view({batch, kv_heads});
  size_t next = 0;
  for (int64_t bh = 0; bh < batch * kv_heads; ++bh) {
    const int64_t len = lengths[static_cast<size_t>(bh)];
    std::vector<int64_t> slots;
    for (int64_t p = 0; p < (len + page_size - 1) / page_size; ++p)
      out.page_table[bh / kv_heads][bh % kv_heads][p] = order[next++];
    for (int64_t t = 0; t < len; ++t)
      slots.push_back(out.page_table[bh / kv_heads][bh % kv_heads][t / page_size].item<int64_t>() * page_size +
                      t % page_size);
    const at::Tensor index = at::tensor(at::ArrayRef<int64_t>(slots), at::kLong);
    out.keys.push_back(out.key_pool.view({-1, dim}).index_select(0, index));
    out.values.push_back(out.value_pool.view({-1, dim}).index_select(0, index));
  }
  return out;
}

double tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 1e-5 : 2e-2; }

TEST(PagedOps, AttentionMatchesDenseAttentionOverEachHeadsTokens) {
  struct Case {
    int64_t batch, kv_heads, groups, n, page_size, dim;
    std::vector<int64_t> lengths;
  };
  const std::vector<Case> cases = {
      {2, 2, 3, 1, 16, 16, {1, 17, 32, 40}},      // one token, a page boundary, exact pages
      {2, 2, 1, 4, 5, 8, {4, 9, 23, 50}},         // n new tokens, odd page size, no GQA
      {1, 1, 4, 1, 16, 64, {3000}},               // one long head: split across threads and merged
      {3, 1, 2, 2, 1, 32, {2, 7, 300}},           // page size 1
      {1, 4, 2, 1, 16, 128, {700, 16, 1, 2049}},  // Llama-like head_dim
  };
  for (const Case& c : cases) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const PagedLayout l = random_layout(c.batch, c.kv_heads, c.lengths, c.page_size, c.dim, dtype, 7);
      const at::Tensor q = randn({c.batch, c.kv_heads * c.groups, c.n, c.dim}, 8, dtype);
      const at::Tensor expected = reference_attention(q, l.keys, l.values, c.kv_heads);
      const at::Tensor kernel = ops::paged_attention(q, l.key_pool, l.value_pool, l.page_table, l.lengths);
      const at::Tensor composite =
          ops::composite::paged_attention(q, l.key_pool, l.value_pool, l.page_table, l.lengths, std::nullopt);
      const double tol = tolerance(dtype);
      EXPECT_EQ(kernel.scalar_type(), dtype);
      EXPECT_TRUE(at::allclose(kernel.to(at::kDouble), expected, tol, tol))
          << dtype << " page " << c.page_size << " max err " << (kernel.to(at::kDouble) - expected).abs().max();
      EXPECT_TRUE(at::allclose(composite.to(at::kDouble), expected, tol, tol)) << dtype << " page " << c.page_size;
    }
  }
}

TEST(PagedOps, AttentionTakesAnExplicitScaleAndStridedQueries) {
  const PagedLayout l = random_layout(1, 2, {33, 5}, 4, 16, at::kFloat, 9);
  const at::Tensor q = randn({1, 2, 16, 4}, 10).transpose(2, 3);  // [1, 2, 4, 16] strided
  const at::Tensor got = ops::paged_attention(q, l.key_pool, l.value_pool, l.page_table, l.lengths, 0.5);
  const at::Tensor expected = reference_attention(q * (0.5 * 4.0), l.keys, l.values, 2);  // 1/sqrt(16) = 0.25
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), expected, 1e-5, 1e-5));
}

TEST(PagedOps, WriteKernelMatchesTheComposite) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor kp = randn({6, 4, 8}, 11, dtype), vp = randn({6, 4, 8}, 12, dtype);
    at::Tensor kc = kp.clone(), vc = vp.clone();
    const at::Tensor rows_k = randn({9, 8}, 13, dtype), rows_v = randn({9, 8}, 14, dtype);
    const at::Tensor slots = at::tensor({23, 0, 5, 6, 7, 12, 13, 1, 19}, at::kLong);
    ops::paged_write(kp, vp, rows_k, rows_v, slots);
    ops::composite::paged_write(kc, vc, rows_k, rows_v, slots);
    EXPECT_TRUE(at::equal(kp, kc)) << dtype;
    EXPECT_TRUE(at::equal(vp, vc)) << dtype;
    EXPECT_TRUE(at::equal(kp.view({-1, 8})[23], rows_k[0])) << dtype;
  }
}

TEST(PagedOps, RejectBadArguments) {
  const PagedLayout l = random_layout(1, 2, {10, 3}, 4, 8, at::kFloat, 15);
  const at::Tensor q = randn({1, 4, 1, 8}, 16);
  const auto both = [&](const at::Tensor& queries, const at::Tensor& table, const at::Tensor& lengths,
                        std::initializer_list<std::string> parts) {
    expect_error([&] { ops::paged_attention(queries, l.key_pool, l.value_pool, table, lengths); }, parts);
    expect_error(
        [&] { ops::composite::paged_attention(queries, l.key_pool, l.value_pool, table, lengths, std::nullopt); },
        parts);
  };
  at::Tensor bad_table = l.page_table.clone();
  bad_table[0][0][1] = l.key_pool.size(0);
  both(q, bad_table, l.lengths, {"paged_attention: page_table must hold pages in [0, ", "got ", "slot 1"});
  both(q, l.page_table, at::tensor({10, 13}, at::kLong).view({1, 2}),
       {"paged_attention: lengths must be in [n (1), max_pages * page_size (12)]", "got 13"});
  both(randn({1, 4, 4, 8}, 17), l.page_table, l.lengths, {"lengths must be in [n (4)", "got 3 for head 1"});
  both(q, l.page_table.to(at::kInt), l.lengths, {"paged_attention: page_table must be int64, got Int"});
  both(randn({1, 3, 1, 8}, 18), l.page_table, l.lengths, {"paged_attention"});
  both(q.to(at::kHalf), l.page_table, l.lengths, {"paged_attention: key_pool must have the dtype of queries (Half)"});
  expect_error([&] { ops::paged_attention(at::Tensor(), l.key_pool, l.value_pool, l.page_table, l.lengths); },
               {"paged_attention", "queries"});

  at::Tensor kp = l.key_pool.clone(), vp = l.value_pool.clone();
  const at::Tensor rows = randn({2, 8}, 19);
  const int64_t capacity = kp.size(0) * 4;  // 7 pages of 4
  expect_error(
      [&] {
        ops::paged_write(kp, vp, rows, rows, at::tensor({int64_t{0}, capacity}, at::kLong));
      },
      {"paged_write: slots must be in [0, num_pages * page_size (28)), got values in [0, 28]"});
  expect_error(
      [&] {
        ops::paged_write(kp, vp, rows.to(at::kHalf), rows.to(at::kHalf), at::tensor({0, 1}, at::kLong));
      },
      {"paged_write: keys and values must be Float like the pools, got Half"});
  expect_error([&] { ops::paged_write(kp, vp, rows, rows, at::tensor({0}, at::kLong)); },
               {"paged_write: slots must be int64 [2]"});
  // A repeated slot would be written twice in no set order: refused, by the kernel and the composite.
  const at::Tensor three = randn({3, 8}, 20);
  for (bool composite : {false, true}) {
    expect_error(
        [&] {
          const at::Tensor slots = at::tensor({int64_t{5}, int64_t{9}, int64_t{5}}, at::kLong);
          composite ? ops::composite::paged_write(kp, vp, three, three, slots)
                    : ops::paged_write(kp, vp, three, three, slots);
        },
        {"paged_write: slots must be distinct (each pool slot written once), got slot 5 more than once"});
  }
  EXPECT_TRUE(at::equal(kp, l.key_pool));  // nothing was written by the refused calls
}

// ---- PagedKVCache ------------------------------------------------------------------------------

PagedCacheOptions small_options(int64_t pages, at::ScalarType dtype = at::kFloat) {
  PagedCacheOptions o;
  o.num_layers = 2;
  o.kv_heads = 2;
  o.head_dim = 16;
  o.pages_per_layer = pages;
  o.page_size = 8;
  o.dtype = dtype;
  return o;
}

// A varlen batch: per sequence random LayerInputs [1, Hkv, S_i, D] (every field a press may read)
// and their keys/values packed along tokens.
struct VarlenBatch {
  std::vector<LayerInputs> inputs;
  at::Tensor keys, values, cu_seqlens;  // [T, Hkv, D], [T, Hkv, D], [B + 1] int32
};

VarlenBatch varlen_batch(const std::vector<int64_t>& lengths, int64_t kv_heads, int64_t groups, int64_t dim,
                         at::ScalarType dtype, uint64_t seed) {
  VarlenBatch v;
  std::vector<at::Tensor> k, val;
  std::vector<int32_t> cu{0};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const testing::Shape s{1, kv_heads, groups, lengths[i], dim, dtype, false, 0.5};
    LayerInputs in = testing::random_inputs(s, seed + i);
    in.layer_idx = 1;
    in.num_layers = 2;
    k.push_back(in.keys[0].transpose(0, 1));  // [S, Hkv, D]
    val.push_back(in.values[0].transpose(0, 1));
    cu.push_back(cu.back() + static_cast<int32_t>(lengths[i]));
    v.inputs.push_back(std::move(in));
  }
  v.keys = at::cat(k).contiguous();
  v.values = at::cat(val).contiguous();
  v.cu_seqlens = at::tensor(at::ArrayRef<int32_t>(cu), at::kInt);
  return v;
}

// The callback store() takes: every field of sequence i but keys/values (the cache sets those).
SequenceInputsFn inputs_of(const VarlenBatch& v) {
  return [&v](int64_t i, LayerInputs& in) {
    const int64_t layer = in.layer_idx, layers = in.num_layers;
    in = v.inputs[static_cast<size_t>(i)];
    in.keys = at::Tensor();
    in.values = at::Tensor();
    in.layer_idx = layer;
    in.num_layers = layers;
  };
}

std::vector<int64_t> as_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

int64_t pages_for(int64_t tokens, int64_t page_size) { return (tokens + page_size - 1) / page_size; }

// Every press of the registry that compresses at prefill (decoding presses act in generation and
// KVComposePress needs the runner's second pass).
std::vector<std::string> prefill_presses() {
  std::vector<std::string> names;
  for (const PressInfo& info : list_presses())
    if (info.kind == PressKind::kScorer || info.kind == PressKind::kWrapper) names.push_back(info.name);
  return names;
}

TEST(PagedCache, StoreKeepsWhatEachSequenceAloneKeepsForEveryPrefillPress) {
  const std::vector<int64_t> lengths = {130, 77, 201};
  const VarlenBatch batch = varlen_batch(lengths, 2, 2, 16, at::kFloat, 20);
  const std::vector<std::string> names = prefill_presses();
  ASSERT_GE(names.size(), 20u);
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    // RandomPress unseeded: it draws in sequence order (below).
    const PressInfo& info = *find_press(name);
    const auto press = make_press(name, ratio_for(info, 0.6), testing::runnable_params(info, batch.inputs[0], ""));
    for (bool padded : {false, true}) {
      PagedKVCache cache(small_options(256));
      const std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence(), cache.add_sequence()};
      at::manual_seed(99);  // RandomPress draws in sequence order, here and alone below
      if (padded) {
        const int64_t s_max = *std::max_element(lengths.begin(), lengths.end());
        std::vector<at::Tensor> k, v;
        for (const LayerInputs& in : batch.inputs) {
          k.push_back(at::constant_pad_nd(in.keys, {0, 0, 0, s_max - in.keys.size(2)}, 7.0));
          v.push_back(at::constant_pad_nd(in.values, {0, 0, 0, s_max - in.values.size(2)}, 7.0));
        }
        cache.store_padded(1, seqs, at::cat(k), at::cat(v), at::tensor(at::ArrayRef<int64_t>(lengths)), press.get(),
                           inputs_of(batch));
      } else {
        cache.store(1, seqs, batch.keys, batch.values, batch.cu_seqlens, press.get(), inputs_of(batch));
      }
      int64_t expected_pages = 0;
      at::manual_seed(99);
      for (size_t i = 0; i < seqs.size(); ++i) {
        const RaggedKV alone = press->compress_ragged(batch.inputs[i]);
        for (int64_t h = 0; h < 2; ++h) {
          const HeadKV& head = alone.at(0, h);
          EXPECT_EQ(cache.positions(seqs[i], 1, h), as_vector(head.kept_indices)) << "sequence " << i << " head " << h;
          EXPECT_TRUE(at::equal(cache.head_keys(seqs[i], 1, h), head.keys)) << "sequence " << i << " head " << h;
          EXPECT_TRUE(at::equal(cache.head_values(seqs[i], 1, h), head.values)) << "sequence " << i << " head " << h;
          expected_pages += pages_for(head.kept_indices.size(0), 8);
        }
        EXPECT_EQ(cache.next_position(seqs[i], 1), press->position_after(lengths[i], alone.at(0, 0).keys.size(0)));
        EXPECT_EQ(cache.lengths(seqs[i], 0), (std::vector<int64_t>{0, 0}));  // other layers untouched
      }
      // Item 6: the pages in use are exactly one partial page per head at most above the kept tokens.
      EXPECT_EQ(cache.stats().pages_used, expected_pages);
    }
  }
}

TEST(PagedCache, StoreWithoutAPressKeepsEveryTokenInEveryDtype) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const VarlenBatch batch = varlen_batch({5, 16, 17}, 2, 1, 16, dtype, 30);
    PagedKVCache cache(small_options(16, dtype));
    const std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence(), cache.add_sequence()};
    cache.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens.to(at::kLong));
    for (size_t i = 0; i < 3; ++i)
      for (int64_t h = 0; h < 2; ++h) {
        EXPECT_TRUE(at::equal(cache.head_keys(seqs[i], 0, h), batch.inputs[i].keys[0][h])) << dtype;
        EXPECT_TRUE(at::equal(cache.head_values(seqs[i], 0, h), batch.inputs[i].values[0][h])) << dtype;
      }
    const PagedCacheStats s = cache.stats();
    EXPECT_EQ(s.pages_used, 2 * (1 + 2 + 3));
    EXPECT_EQ(s.pages_free, 2 * 16 - s.pages_used);
    EXPECT_EQ(s.bytes_per_page, 2 * 8 * 16 * static_cast<int64_t>(c10::elementSize(dtype)));
    EXPECT_EQ(s.tokens, 2 * (5 + 16 + 17));
  }
}

TEST(PagedCache, FreedPagesAreTakenByTheNextSequence) {
  PagedKVCache cache(small_options(6));
  const VarlenBatch batch = varlen_batch({24}, 2, 1, 16, at::kFloat, 40);  // 3 pages per head: the whole pool
  const SequenceId a = cache.add_sequence();
  cache.store(0, {a}, batch.keys, batch.values, batch.cu_seqlens);
  EXPECT_EQ(cache.free_pages(0), 0);
  const SequenceId b = cache.add_sequence();
  expect_error([&] { cache.store(0, {b}, batch.keys, batch.values, batch.cu_seqlens); },
               {"PagedKVCache: out of pages at layer 0: the write needs 6 new pages of 8 tokens, 0 are free",
                "nothing was written"});
  cache.free_sequence(a);
  EXPECT_FALSE(cache.contains(a));
  EXPECT_EQ(cache.free_pages(0), 6);
  cache.store(0, {b}, batch.keys, batch.values, batch.cu_seqlens);
  EXPECT_TRUE(at::equal(cache.head_keys(b, 0, 1), batch.inputs[0].keys[0][1]));
  EXPECT_EQ(cache.stats().peak_pages_used, 6);
  expect_error([&] { cache.free_sequence(a); }, {"PagedKVCache::free_sequence: sequence 0 is not in the cache"});
}

TEST(PagedCache, FailuresLeaveTheCacheAsItWas) {
  const VarlenBatch batch = varlen_batch({90, 40, 70}, 2, 2, 16, at::kFloat, 50);
  PagedKVCache cache(small_options(64));
  const std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence(), cache.add_sequence()};
  const auto snapshot = [&] {
    std::vector<std::vector<int64_t>> s;
    for (SequenceId q : seqs)
      for (int64_t h = 0; h < 2; ++h) {
        s.push_back(cache.positions(q, 0, h));
        s.push_back(cache.pages(q, 0, h));
      }
    s.push_back({cache.free_pages(0), cache.stats().peak_pages_used});
    return s;
  };
  const auto before = snapshot();
  // SnapKVPress needs S > window_size (64): sequence 1 (40 tokens) fails after sequence 0 was scored.
  const auto snapkv = make_press("SnapKVPress", 0.5);
  expect_error(
      [&] { cache.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens, snapkv.get(), inputs_of(batch)); },
      {"SnapKVPress"});
  EXPECT_EQ(snapshot(), before);
  // Out of pages: the three sequences take 2 x (12 + 5 + 9) = 52 of 64 pages; 120 more tokens need 30.
  cache.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens);
  const auto stored = snapshot();
  const SequenceId extra = cache.add_sequence();
  const VarlenBatch big = varlen_batch({120}, 2, 1, 16, at::kFloat, 51);
  expect_error([&] { cache.store(0, {extra}, big.keys, big.values, big.cu_seqlens); }, {"out of pages at layer 0"});
  EXPECT_EQ(snapshot(), stored);
  EXPECT_EQ(cache.lengths(extra, 0), (std::vector<int64_t>{0, 0}));
  // 30 tokens appended to all three need 2 x (3 + 4 + 4) = 22 new pages, 12 are free.
  const at::Tensor step = randn({3, 2, 30, 16}, 52);
  expect_error([&] { cache.append(0, seqs, step, step); }, {"out of pages at layer 0"});
  EXPECT_EQ(snapshot(), stored);
  // Bad arguments name the function and the argument.
  expect_error([&] { cache.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens); },
               {"PagedKVCache::store: sequence 0 already holds layer 0"});
  expect_error([&] { cache.store(2, {extra}, big.keys, big.values, big.cu_seqlens); },
               {"PagedKVCache::store: layer must be in [0, 2), got 2"});
  expect_error(
      [&] {
        cache.store(1, {extra, extra}, big.keys, big.values, at::tensor({0, 60, 120}, at::kInt));
      },
      {"PagedKVCache::store: seqs must be distinct, got sequence 3 twice"});
  expect_error([&] { cache.store(1, {extra}, big.keys.to(at::kHalf), big.values.to(at::kHalf), big.cu_seqlens); },
               {"PagedKVCache::store: keys and values must be Float like the cache, got Half"});
  expect_error(
      [&] {
        cache.store(1, {extra}, big.keys, big.values, at::tensor({0, 119}, at::kInt));
      },
      {"PagedKVCache::store: cu_seqlens must run from 0 to total_tokens (120), got 0 .. 119"});
  expect_error(
      [&] {
        cache.append(1, {extra}, randn({1, 2, 1, 8}, 53), randn({1, 2, 1, 8}, 54));
      },
      {"PagedKVCache::append: keys must be [1, 2, n, 16]"});
  expect_error(
      [&] {
        cache.compact(0, seqs[0], at::ones({2, 10}, at::kBool));
      },
      {"PagedKVCache::compact: keep_mask must be [2, L >= 90]"});
  expect_error([&] { PagedKVCache(small_options(0)); }, {"PagedKVCache: pages_per_layer must be > 0, got 0"});
}

TEST(PagedCache, AppendAndAttentionEqualDenseAttentionOverTheKeptTokens) {
  const std::vector<int64_t> lengths = {150, 75, 230};
  for (const char* name : {"SnapKVPress", "AdaKVPress", "KnormPress"}) {
    SCOPED_TRACE(name);
    const VarlenBatch batch = varlen_batch(lengths, 2, 3, 16, at::kFloat, 60);
    const auto press = make_press(name, 0.7);
    PagedKVCache cache(small_options(200));
    const std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence(), cache.add_sequence()};
    cache.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens, press.get(), inputs_of(batch));
    std::vector<at::Tensor> ref_keys, ref_values;  // per head: the press's kept rows, then the new ones
    for (size_t i = 0; i < seqs.size(); ++i) {
      const RaggedKV alone = press->compress_ragged(batch.inputs[i]);
      for (int64_t h = 0; h < 2; ++h) {
        ref_keys.push_back(alone.at(0, h).keys);
        ref_values.push_back(alone.at(0, h).values);
      }
    }
    for (int64_t n : {1, 3, 1, 20}) {  // decoding steps, a question of 3 tokens, a long one
      const at::Tensor k = randn({3, 2, n, 16}, 61 + n), v = randn({3, 2, n, 16}, 62 + n);
      const at::Tensor q = randn({3, 6, n, 16}, 63 + n);
      cache.append(0, seqs, k, v);
      for (int64_t bh = 0; bh < 6; ++bh) {
        ref_keys[static_cast<size_t>(bh)] = at::cat({ref_keys[static_cast<size_t>(bh)], k[bh / 2][bh % 2]});
        ref_values[static_cast<size_t>(bh)] = at::cat({ref_values[static_cast<size_t>(bh)], v[bh / 2][bh % 2]});
      }
      const at::Tensor got = cache.attention(0, seqs, q);
      const at::Tensor expected = reference_attention(q, ref_keys, ref_values, 2);
      EXPECT_TRUE(at::allclose(got.to(at::kDouble), expected, 1e-5, 1e-5))
          << "n " << n << " max err " << (got.to(at::kDouble) - expected).abs().max();
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::vector<int64_t> pos = cache.positions(seqs[i], 0, 0);
      const int64_t stored = static_cast<int64_t>(pos.size()) - 25;  // 1 + 3 + 1 + 20 appended
      EXPECT_EQ(pos[static_cast<size_t>(stored)], lengths[i]) << "appended tokens continue after the prefill";
      EXPECT_EQ(pos.back(), lengths[i] + 24);
      EXPECT_EQ(cache.next_position(seqs[i], 0), lengths[i] + 25);
    }
  }
}

// Item 3 of issue 36 (the transfer's cache side): an exported sequence adopted by a cache with
// another page size and pool holds the same tokens, positions and next positions, attends alike,
// and grows alike; a cache of another shape, or one too small, refuses it and stays as it was.
TEST(PagedCache, AnAdoptedSequenceHoldsAndAttendsAsTheExportedOne) {
  const VarlenBatch batch = varlen_batch({61, 100}, 2, 1, 16, at::kFloat, 75);
  PagedKVCache source(small_options(64));
  const std::vector<SequenceId> seqs = {source.add_sequence(), source.add_sequence()};
  const auto adakv = make_press("AdaKVPress", 0.3);  // heads of different lengths
  source.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens, adakv.get(), inputs_of(batch));
  source.append(0, seqs, randn({2, 2, 5, 16}, 76), randn({2, 2, 5, 16}, 77));  // layer 1 stays empty
  const SequenceTokens tokens = source.export_sequence(seqs[1]);
  EXPECT_EQ(tokens.tokens(), source.length(seqs[1], 0, 0) + source.length(seqs[1], 0, 1));
  EXPECT_EQ(tokens.keys.size(0), tokens.tokens());
  PagedCacheOptions other = small_options(40);
  other.page_size = 5;
  PagedKVCache target(other);
  const SequenceId filler = target.add_sequence();  // pages of another sequence first: different page ids
  target.append(0, {filler}, randn({1, 2, 7, 16}, 78), randn({1, 2, 7, 16}, 79));
  const SequenceId adopted = target.adopt_sequence(tokens);
  for (int64_t layer : {0, 1}) {
    EXPECT_EQ(target.lengths(adopted, layer), source.lengths(seqs[1], layer));
    EXPECT_EQ(target.next_position(adopted, layer), source.next_position(seqs[1], layer));
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(target.positions(adopted, layer, h), source.positions(seqs[1], layer, h));
      EXPECT_TRUE(at::equal(target.head_keys(adopted, layer, h), source.head_keys(seqs[1], layer, h)));
      EXPECT_TRUE(at::equal(target.head_values(adopted, layer, h), source.head_values(seqs[1], layer, h)));
    }
  }
  EXPECT_NE(target.lengths(adopted, 0)[0], target.lengths(adopted, 0)[1]);  // a ragged sequence
  // Both caches decode one more token alike.
  const at::Tensor k = randn({1, 2, 1, 16}, 80), v = randn({1, 2, 1, 16}, 81), q = randn({1, 6, 1, 16}, 82);
  source.append(0, {seqs[1]}, k, v);
  target.append(0, {adopted}, k, v);
  EXPECT_TRUE(at::allclose(target.attention(0, {adopted}, q), source.attention(0, {seqs[1]}, q), 1e-6, 1e-6));
  EXPECT_EQ(target.positions(adopted, 0, 1).back(), 100 + 5);

  // Refusals leave the cache as it was.
  PagedCacheOptions tight = other;
  tight.pages_per_layer = 10;  // the sequence's layer 0 needs more
  PagedKVCache small(tight);
  expect_error([&] { small.adopt_sequence(tokens); },
               {"PagedKVCache::adopt_sequence: out of pages at layer 0: the sequence needs", "nothing was adopted"});
  EXPECT_EQ(small.stats().pages_used, 0);
  EXPECT_TRUE(small.sequences().empty());
  PagedKVCache half(small_options(64, at::kHalf));
  expect_error([&] { half.adopt_sequence(tokens); },
               {"PagedKVCache::adopt_sequence: tokens must come from a cache of 2 layers, 2 KV heads, head_dim 16 and "
                "Half like this one, got 2 layers, 2 KV heads, head_dim 16 and Float"});
  SequenceTokens short_keys = tokens;
  short_keys.keys = tokens.keys.narrow(0, 1, tokens.tokens() - 1);
  expect_error([&] { target.adopt_sequence(short_keys); },
               {"PagedKVCache::adopt_sequence: tokens.keys and tokens.values must be [", "got ["});
  EXPECT_EQ(target.sequences(), (std::vector<SequenceId>{filler, adopted}));
  expect_error([&] { source.export_sequence(9); }, {"PagedKVCache::export_sequence: sequence 9 is not in the cache"});
}

TEST(PagedCache, CompactMovesKeptTokensForwardAndReturnsEmptiedPages) {
  const VarlenBatch batch = varlen_batch({61, 100}, 2, 1, 16, at::kFloat, 70);
  PagedKVCache cache(small_options(64));
  const std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence()};
  const auto adakv = make_press("AdaKVPress", 0.3);  // heads of different lengths
  cache.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens, adakv.get(), inputs_of(batch));
  cache.append(0, seqs, randn({2, 2, 5, 16}, 71), randn({2, 2, 5, 16}, 72));
  const std::vector<int64_t> len = cache.lengths(seqs[1], 0);
  ASSERT_NE(len[0], len[1]);
  const int64_t width = std::max(len[0], len[1]) + 3;
  at::Tensor mask = at::rand({2, width}, at::kFloat) < 0.35;
  for (int64_t h = 0; h < 2; ++h)
    mask[h].narrow(0, len[static_cast<size_t>(h)], width - len[static_cast<size_t>(h)]).fill_(false);
  std::vector<at::Tensor> expected_keys, expected_values;
  std::vector<std::vector<int64_t>> expected_positions;
  for (int64_t h = 0; h < 2; ++h) {
    const at::Tensor kept = mask[h].narrow(0, 0, len[static_cast<size_t>(h)]).nonzero().flatten();
    expected_keys.push_back(cache.head_keys(seqs[1], 0, h).index_select(0, kept));
    expected_values.push_back(cache.head_values(seqs[1], 0, h).index_select(0, kept));
    std::vector<int64_t> p;
    const std::vector<int64_t> all = cache.positions(seqs[1], 0, h);
    for (int64_t t : as_vector(kept)) p.push_back(all[static_cast<size_t>(t)]);
    expected_positions.push_back(p);
  }
  const std::vector<int64_t> first_pages_0 = cache.pages(seqs[1], 0, 0);
  const std::vector<int64_t> untouched = cache.positions(seqs[0], 0, 1);
  const int64_t free_before = cache.free_pages(0);
  const int64_t pages_before =
      static_cast<int64_t>(cache.pages(seqs[1], 0, 0).size() + cache.pages(seqs[1], 0, 1).size());
  cache.compact(0, seqs[1], mask);
  int64_t pages_after = 0;
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_TRUE(at::equal(cache.head_keys(seqs[1], 0, h), expected_keys[static_cast<size_t>(h)])) << h;
    EXPECT_TRUE(at::equal(cache.head_values(seqs[1], 0, h), expected_values[static_cast<size_t>(h)])) << h;
    EXPECT_EQ(cache.positions(seqs[1], 0, h), expected_positions[static_cast<size_t>(h)]);
    const auto kept = static_cast<int64_t>(expected_positions[static_cast<size_t>(h)].size());
    EXPECT_EQ(static_cast<int64_t>(cache.pages(seqs[1], 0, h).size()), pages_for(kept, 8));
    pages_after += pages_for(kept, 8);
  }
  // The head keeps its own first pages (no copy to new ones); the rest went back to the pool.
  const std::vector<int64_t>& now = cache.pages(seqs[1], 0, 0);
  EXPECT_TRUE(std::equal(now.begin(), now.end(), first_pages_0.begin()));
  EXPECT_EQ(cache.free_pages(0), free_before + pages_before - pages_after);
  EXPECT_EQ(cache.positions(seqs[0], 0, 1), untouched);
  // Decoding continues after a compaction at the next position.
  const int64_t next = cache.next_position(seqs[1], 0);
  cache.append(0, {seqs[1]}, randn({1, 2, 1, 16}, 73), randn({1, 2, 1, 16}, 74));
  EXPECT_EQ(cache.positions(seqs[1], 0, 0).back(), next);
}

// ---- CUDA (skipped without a GPU) ----------------------------------------------------------------

// The device tables the kernels read equal the host's page lists and lengths after every kind of
// change: stores with and without a press, appends that take pages, removals, compactions, resets,
// frees and slots reused by new sequences, with the tables growing past their first capacity.
void expect_tables_match(const PagedKVCache& cache, int64_t layer, const std::vector<SequenceId>& seqs) {
  const PagedBatchView view = cache.batch_view(layer, seqs);
  const at::Tensor table = view.page_table.cpu(), lengths = view.lengths.cpu();
  ASSERT_EQ(table.size(0), static_cast<int64_t>(seqs.size()));
  for (size_t b = 0; b < seqs.size(); ++b) {
    for (int64_t h = 0; h < cache.options().kv_heads; ++h) {
      const std::vector<int64_t>& pages = cache.pages(seqs[b], layer, h);
      EXPECT_EQ(lengths[static_cast<int64_t>(b)][h].item<int64_t>(), cache.length(seqs[b], layer, h));
      ASSERT_LE(static_cast<int64_t>(pages.size()), table.size(2));
      for (size_t j = 0; j < pages.size(); ++j)
        EXPECT_EQ(table[static_cast<int64_t>(b)][h][static_cast<int64_t>(j)].item<int64_t>(), pages[j])
            << "sequence " << seqs[b] << " head " << h << " page " << j;
    }
  }
}

TEST(PagedCache, DeviceTablesFollowEveryChange) {
  PagedKVCache cache(small_options(2000));
  const PagedCacheOptions& opt = cache.options();
  const int64_t hkv = opt.kv_heads, d = opt.head_dim;
  at::manual_seed(7);
  std::vector<SequenceId> live;
  const auto check_all = [&] {
    if (live.empty()) return;
    for (int64_t layer = 0; layer < opt.num_layers; ++layer) {
      expect_tables_match(cache, layer, live);
      std::vector<SequenceId> reversed(live.rbegin(), live.rend());  // any order, any subset
      expect_tables_match(cache, layer, reversed);
    }
  };
  const auto press = make_press("AdaKVPress", 0.5, {{"press", "KnormPress"}});  // heads keep different counts
  for (int round = 0; round < 12; ++round) {
    // Two new sequences (more than the first 8 slots over the rounds), one stored through a press.
    const std::vector<SequenceId> added = {cache.add_sequence(), cache.add_sequence()};
    const int64_t s0 = 20 + 13 * round, s1 = 5 + 7 * round;
    const at::Tensor cu = at::tensor({int64_t{0}, s0, s0 + s1});
    for (int64_t layer = 0; layer < opt.num_layers; ++layer)
      cache.store(layer, added, at::randn({s0 + s1, hkv, d}), at::randn({s0 + s1, hkv, d}), cu,
                  layer == 0 ? press.get() : nullptr);
    live.insert(live.end(), added.begin(), added.end());
    check_all();
    // Appends that cross page boundaries, then a removal of the last of them.
    for (int64_t layer = 0; layer < opt.num_layers; ++layer) {
      const auto batch = static_cast<int64_t>(live.size());
      cache.append(layer, live, at::randn({batch, hkv, 9, d}), at::randn({batch, hkv, 9, d}));
      cache.remove_last(layer, live, 3);
    }
    check_all();
    // Compact the oldest sequence to every other token.
    for (int64_t layer = 0; layer < opt.num_layers; ++layer) {
      const std::vector<int64_t> len = cache.lengths(live.front(), layer);
      const int64_t longest = *std::max_element(len.begin(), len.end());
      at::Tensor keep = (at::arange(longest) % 2 == 0).unsqueeze(0).repeat({hkv, 1});
      for (int64_t h = 0; h < hkv; ++h)
        keep[h].narrow(0, len[static_cast<size_t>(h)], longest - len[static_cast<size_t>(h)]).fill_(false);
      cache.compact(layer, live.front(), keep);
    }
    check_all();
    // Free the oldest sequence (its slot goes to a later one); now and then reset and refill one.
    if (live.size() > 6) {
      cache.free_sequence(live.front());
      live.erase(live.begin());
      check_all();
    }
    if (round % 3 == 2) {
      cache.reset_sequence(live.back());
      check_all();
      for (int64_t layer = 0; layer < opt.num_layers; ++layer)
        cache.store(layer, {live.back()}, at::randn({40, hkv, d}), at::randn({40, hkv, d}),
                    at::tensor({int64_t{0}, int64_t{40}}));
      check_all();
    }
  }
  EXPECT_GT(cache.stats().table_bytes, 0);
  // After every sequence is freed, a new one starts with zero lengths in a reused slot.
  for (SequenceId s : live) cache.free_sequence(s);
  const SequenceId fresh = cache.add_sequence();
  expect_tables_match(cache, 0, {fresh});
  EXPECT_EQ(cache.stats().pages_used, 0);
}

// A mutation that fails part-way (a tensor allocation, a page taken, the tables growing or an upload
// to the device; injected here at each of the call's fault points in turn, fault_sweep.h) leaves the
// cache as it was: page lists, positions, rows, free pages and the device tables, for every
// mutation, on a full and a quantized cache. The same call then succeeds and the tables follow it:
// no entry is left unsent.
TEST(PagedCache, AFailureAtAnyFaultPointLeavesTheCacheAsItWas) {
  for (const KVFormat format : {KVFormat::kFull, KVFormat::kInt4}) {
    PagedCacheOptions options = small_options(200);
    options.kv_format = format;
    PagedKVCache cache(options);
    const int64_t hkv = options.kv_heads, d = options.head_dim;
    at::manual_seed(11);
    std::vector<SequenceId> seqs = {cache.add_sequence(), cache.add_sequence()};
    for (int64_t idle = 0; idle < 6; ++idle) cache.add_sequence();  // every slot of the first tables taken
    const auto tables_match = [&] {
      for (int64_t layer = 0; layer < options.num_layers; ++layer) expect_tables_match(cache, layer, cache.sequences());
    };
    const auto press = make_press("AdaKVPress", 0.5, {{"press", "KnormPress"}});
    const at::Tensor cu = at::tensor({int64_t{0}, int64_t{37}, int64_t{37 + 21}});
    const at::Tensor prefill_k = at::randn({58, hkv, d}), prefill_v = at::randn({58, hkv, d});
    const at::Tensor step_k = at::randn({2, hkv, 9, d}), step_v = at::randn({2, hkv, 9, d});
    struct Mutation {
      const char* name;
      int points;  // fault points the call has at least (table growth, uploads)
      std::function<void()> run;
    };
    const std::vector<Mutation> mutations = {
        {"add_sequence (the tables grow)", 1, [&] { seqs.push_back(cache.add_sequence()); }},
        {"store", 1,
         [&] {
           cache.store(0, {seqs[0], seqs[1]}, prefill_k, prefill_v, cu, press.get());
         }},
        {"store without a press", 1,
         [&] {
           cache.store(1, {seqs[0], seqs[1]}, prefill_k, prefill_v, cu);
         }},
        {"append", 1,
         [&] {
           cache.append(0, {seqs[0], seqs[1]}, step_k, step_v);
         }},
        {"remove_last", 1,
         [&] {
           cache.remove_last(0, {seqs[0], seqs[1]}, 4);
         }},
        {"compact", 1,
         [&] {
           const std::vector<int64_t> len = cache.lengths(seqs[0], 0);
           const int64_t longest = *std::max_element(len.begin(), len.end());
           at::Tensor keep = (at::arange(longest) % 3 != 1).unsqueeze(0).repeat({hkv, 1});
           for (int64_t h = 0; h < hkv; ++h)
             keep[h].narrow(0, len[static_cast<size_t>(h)], longest - len[static_cast<size_t>(h)]).fill_(false);
           cache.compact(0, seqs[0], keep);
         }},
        {"adopt_sequence", 2, [&] { seqs.push_back(cache.adopt_sequence(cache.export_sequence(seqs[1]))); }},
        {"reset_sequence", 2, [&] { cache.reset_sequence(seqs[1]); }},
        {"free_sequence", 2, [&] { cache.free_sequence(seqs[0]); }},
    };
    for (const Mutation& m : mutations) {
      const testing::CacheImage before = testing::image_of(cache);
      const int64_t failures = testing::sweep_fault_points(m.run, [&] {
        EXPECT_TRUE(testing::same_image(testing::image_of(cache), before)) << kv_format_name(format) << " " << m.name;
        tables_match();
      });
      EXPECT_GE(failures, m.points) << kv_format_name(format) << " " << m.name;
      tables_match();
    }
    EXPECT_FALSE(cache.contains(seqs[0]));
    EXPECT_EQ(cache.lengths(seqs[1], 0), (std::vector<int64_t>{0, 0}));
  }
}

TEST(PagedCuda, AttentionMatchesCpuIncludingSplitHeads) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  // Few units with long heads take the split-and-reduce path; many short ones a single split. Every
  // head holds at least n = 2 tokens (the queries are its last n).
  for (const std::vector<int64_t>& lengths : {std::vector<int64_t>{16384, 3, 700, 2}, std::vector<int64_t>(64, 40)}) {
    const int64_t kv_heads = 2, batch = static_cast<int64_t>(lengths.size()) / kv_heads;
    for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      const PagedLayout l = random_layout(batch, kv_heads, lengths, 16, 128, dtype, 80);
      for (int64_t n : {1, 2}) {
        const at::Tensor q = randn({batch, 8, n, 128}, 81, dtype);
        const at::Tensor cpu = ops::paged_attention(q, l.key_pool, l.value_pool, l.page_table, l.lengths);
        if (!no_cuda.empty()) continue;
        const at::Tensor gpu = ops::paged_attention(q.cuda(), l.key_pool.cuda(), l.value_pool.cuda(),
                                                    l.page_table.cuda(), l.lengths.cuda())
                                   .cpu();
        const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
        EXPECT_TRUE(at::allclose(cpu.to(at::kFloat), gpu.to(at::kFloat), tol, tol))
            << dtype << " n " << n << " max err " << (cpu.to(at::kFloat) - gpu.to(at::kFloat)).abs().max();
      }
    }
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(PagedCuda, WriteMatchesCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    at::Tensor kp = randn({50, 16, 64}, 82, dtype), vp = randn({50, 16, 64}, 83, dtype);
    const at::Tensor rows_k = randn({300, 64}, 84, dtype), rows_v = randn({300, 64}, 85, dtype);
    const at::Tensor slots = at::randperm(800, at::kLong).narrow(0, 0, 300);
    at::Tensor kg = kp.clone(), vg = vp.clone();
    ops::paged_write(kp, vp, rows_k, rows_v, slots);
    if (!no_cuda.empty()) continue;
    kg = kg.cuda();
    vg = vg.cuda();
    ops::paged_write(kg, vg, rows_k.cuda(), rows_v.cuda(), slots.cuda());
    EXPECT_TRUE(at::equal(kp, kg.cpu())) << dtype;
    EXPECT_TRUE(at::equal(vp, vg.cpu())) << dtype;
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

// What the CUDA bridges check on the host when device argument checks are off: shapes, dtypes and
// devices only, never the contents of the tables, lengths or slots. Meta tensors have no contents,
// so reading them raises: the checks pass on them with kLeaveOnDevice and raise with kRead.
TEST(PagedOps, ChecksLeftOnTheDeviceReadNoIndexContents) {
  const auto meta = [](std::initializer_list<int64_t> shape, at::ScalarType dtype) {
    return at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kMeta));
  };
  const at::Tensor q = meta({2, 4, 1, 64}, at::kFloat), pool = meta({10, 16, 64}, at::kFloat);
  const at::Tensor table = meta({2, 2, 5}, at::kLong), lengths = meta({2, 2}, at::kLong);
  const checks::PagedAttentionArgs a =
      checks::paged_attention_args(q, pool, pool, table, lengths, std::nullopt, checks::IndexContents::kLeaveOnDevice);
  EXPECT_FALSE(a.host_lengths.defined() || a.host_page_table.defined());
  EXPECT_THROW(checks::paged_attention_args(q, pool, pool, table, lengths, std::nullopt, checks::IndexContents::kRead),
               c10::Error);
  at::Tensor key_pool = pool, value_pool = meta({10, 16, 64}, at::kFloat);
  const at::Tensor rows = meta({3, 64}, at::kFloat), slots = meta({3}, at::kLong);
  checks::check_paged_write(key_pool, value_pool, rows, rows, slots, checks::IndexContents::kLeaveOnDevice);
  EXPECT_THROW(checks::check_paged_write(key_pool, value_pool, rows, rows, slots, checks::IndexContents::kRead),
               c10::Error);
  // Shapes are still checked without the contents.
  expect_error(
      [&] {
        checks::paged_attention_args(q, pool, pool, table, meta({2, 3}, at::kLong), std::nullopt,
                                     checks::IndexContents::kLeaveOnDevice);
      },
      {"paged_attention: lengths must be [2, 2], got [2, 3]"});
}

// The switch and its default: off unless KVPRESS_CHECK_DEVICE_ARGUMENTS=1 was set at load (ctest
// does not set it). CPU tensors are checked on the host either way.
TEST(PagedOps, DeviceArgumentChecksAreASwitchCpuIgnores) {
  ASSERT_FALSE(ops::device_argument_checks());
  const PagedLayout l = random_layout(1, 1, {20}, 16, 32, at::kFloat, 90);
  const at::Tensor q = randn({1, 1, 1, 32}, 91);
  for (const bool on : {true, false}) {
    ops::set_device_argument_checks(on);
    EXPECT_EQ(ops::device_argument_checks(), on);
    expect_error([&] { ops::paged_attention(q, l.key_pool, l.value_pool, l.page_table, l.lengths + 100); },
                 {"paged_attention: lengths must be in [n (1), max_pages * page_size (32)]"});
  }
  ops::check_device_errors(at::Device(at::kCPU));  // nothing to report on the CPU
}

// A decode step on CUDA (paged_write of the new token's K/V, then paged_attention) makes no host
// synchronisation: counted by c10's sync-debug mode, which warns at every synchronising call. The
// count is checked to see synchronisations (device argument checks on: one per call). Bad device
// data is then reported by check_device_errors, once.
TEST(PagedCuda, DecodeStepMakesNoHostSynchronisation) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
#if KVPRESS_TESTS_WITH_CUDA
  const PagedLayout l = random_layout(2, 2, {700, 3, 40, 2}, 16, 128, at::kHalf, 92);
  at::Tensor key_pool = l.key_pool.cuda(), value_pool = l.value_pool.cuda();
  const at::Tensor page_table = l.page_table.cuda(), lengths = l.lengths.cuda();
  const at::Tensor q = randn({2, 8, 1, 128}, 93, at::kHalf).cuda();
  const at::Tensor rows = randn({4, 128}, 94, at::kHalf).cuda();
  const at::Tensor slots = at::arange(4, at::kLong).cuda() + 16 * (key_pool.size(0) - 1);  // the unused last page
  const auto step = [&] {
    ops::paged_write(key_pool, value_pool, rows, rows, slots);
    return ops::paged_attention(q, key_pool, value_pool, page_table, lengths);
  };
  step();  // warm-up: allocates the device's error word
  c10::cuda::device_synchronize();
  const auto count_synchronisations = [&](bool device_checks) {
    int count = 0;
    struct Counter : c10::WarningHandler {
      int* count;
      void process(const c10::Warning& w) override {
        if (w.msg().find("synchroniz") != std::string::npos) ++*count;
      }
    } counter;
    counter.count = &count;
    const c10::WarningUtils::WarningHandlerGuard handler(&counter);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    ops::set_device_argument_checks(device_checks);
    step();
    ops::set_device_argument_checks(false);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    return count;
  };
  EXPECT_EQ(count_synchronisations(false), 0);
  EXPECT_GE(count_synchronisations(true), 2) << "the counter must see the host checks' copies";
  ops::check_device_errors(q.device());  // nothing wrong so far
  const at::Tensor out = ops::paged_attention(q, key_pool, value_pool, page_table, lengths + 10000);
  expect_error([&] { ops::check_device_errors(q.device()); },
               {"check_device_errors",
                "paged_attention (paged_attention_quantized) got lengths outside [n, max_pages * page_size]"});
  EXPECT_TRUE(at::isnan(out.cpu()).all().item<bool>());
  ops::check_device_errors(q.device());  // cleared
#endif
}

TEST(PagedCuda, CacheOnCudaKeepsAndAttendsAsOnCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  const bool with_gpu = no_cuda.empty();
  const VarlenBatch batch = varlen_batch({300, 130, 520}, 2, 2, 16, at::kFloat, 86);
  VarlenBatch on_gpu = batch;
  if (with_gpu) {
    for (LayerInputs& in : on_gpu.inputs)
      for_each_field(in, [](const LayerInputField&, auto& member) {
        if constexpr (std::is_same_v<std::decay_t<decltype(member)>, at::Tensor>)
          if (member.defined()) member = member.cuda();
      });
    on_gpu.keys = batch.keys.cuda();
    on_gpu.values = batch.values.cuda();
  }
  for (const char* name : {"SnapKVPress", "AdaKVPress", "KnormPress", "ExpectedAttentionPress"}) {
    SCOPED_TRACE(name);
    const auto press = make_press(name, 0.6);
    PagedCacheOptions cpu_options = small_options(256), gpu_options = cpu_options;
    gpu_options.device = at::kCUDA;
    // The CUDA cache exists only where the CUDA half runs (its constructor allocates on the device).
    PagedKVCache cpu(cpu_options);
    std::unique_ptr<PagedKVCache> gpu_cache = with_gpu ? std::make_unique<PagedKVCache>(gpu_options) : nullptr;
    std::vector<SequenceId> seqs;
    for (int i = 0; i < 3; ++i) {
      seqs.push_back(cpu.add_sequence());
      if (with_gpu) ASSERT_EQ(gpu_cache->add_sequence(), seqs.back());  // ids are handed out in order
    }
    cpu.store(0, seqs, batch.keys, batch.values, batch.cu_seqlens, press.get(), inputs_of(batch));
    const at::Tensor k = randn({3, 2, 1, 16}, 87), v = randn({3, 2, 1, 16}, 88), q = randn({3, 4, 1, 16}, 89);
    cpu.append(0, seqs, k, v);
    const at::Tensor cpu_attention = cpu.attention(0, seqs, q);
    const std::vector<int64_t> len = cpu.lengths(seqs[2], 0);
    at::Tensor mask = at::rand({2, std::max(len[0], len[1])}) < 0.5;
    for (int64_t h = 0; h < 2; ++h)
      mask[h].narrow(0, len[static_cast<size_t>(h)], mask.size(1) - len[static_cast<size_t>(h)]).fill_(false);
    cpu.compact(0, seqs[2], mask);
    if (!with_gpu) continue;
    PagedKVCache& gpu = *gpu_cache;
    gpu.store(0, seqs, on_gpu.keys, on_gpu.values, batch.cu_seqlens.cuda(), press.get(), inputs_of(on_gpu));
    gpu.append(0, seqs, k.cuda(), v.cuda());
    EXPECT_TRUE(at::allclose(cpu_attention, gpu.attention(0, seqs, q.cuda()).cpu(), 1e-5, 1e-5));
    gpu.compact(0, seqs[2], mask.cuda());
    for (SequenceId s : seqs)
      for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(cpu.positions(s, 0, h), gpu.positions(s, 0, h));
    EXPECT_TRUE(at::equal(cpu.head_keys(seqs[2], 0, 1), gpu.head_keys(seqs[2], 0, 1).cpu()));
    EXPECT_EQ(cpu.stats().pages_used, gpu.stats().pages_used);
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

}  // namespace
}  // namespace kvpress
