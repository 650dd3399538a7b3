// Every CUDA kernel of src/ops/<family>/cuda, run on the CPU through the execution model of
// tests/cuda_emulation (a block's threads as fibers, barriers, warp collectives, launch limits), against
// the op's CPU kernel, on shapes that reach every tail. The launchers are the ones nvcc compiles
// (same grid, block, shared memory and splits), so this runs the launch the GPU would get.
// Its own binary: scripts/test_tsan.sh and scripts/test_sanitized.sh run it instrumented.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "compactor/compactor.h"
#include "kvpress/ops.h"
#include "paged/paged.h"
#include "quantized_pages.h"
#include "ragged_attention/ragged_attention.h"
#include "rope_heads/rope_heads.h"
#include "scores/scores.h"
#include "selection/selection.h"
#include "test_util.h"

// After every other header: the model redefines CUDA's names for what follows.
#include "cuda_emulation/cuda_emulation.h"
// Hidden: the test binary's instances of the launchers must not stand in for libkvpress.so's own
// (the target is also compiled with -fvisibility=hidden, tests/CMakeLists.txt).
#pragma GCC visibility push(hidden)
#include "compactor/cuda/leverage.cuh"
#include "compactor/cuda/noncausal.cuh"
#include "compactor/cuda/prerope.cuh"
#include "cuda/shapes.h"
#include "paged/cuda/paged.cuh"
#include "ragged_attention/cuda/ragged_attention.cuh"
#include "rope_heads/cuda/invert_rope.cuh"
#include "rope_heads/cuda/window_attention.cuh"
#include "rope_heads/cuda/window_attention_heads.h"
#include "scores/cuda/key_norm.cuh"
#include "scores/cuda/keydiff.cuh"
#include "scores/cuda/lagkv.cuh"
#include "selection/cuda/selection.cuh"
#pragma GCC visibility pop

namespace {

namespace emu = kvpress::cuda_emulation;
namespace cu = kvpress::cuda;

// Calls f(CudaType{}) for a tensor dtype, as src/ops/cuda/dispatch.h does.
template <typename F>
void with_cuda_type(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: FAIL() << "no CUDA element type for " << type;
  }
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}
template <typename T>
T* mut(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void expect_launched(cudaError_t err) {
  // The error's number, not cudaGetErrorName: the model needs CUDA's headers only, not its runtime
  // library (the sanitized trees link no CUDA library); the model's message names the error.
  ASSERT_EQ(err, cudaSuccess) << "cudaError_t " << static_cast<int>(err) << ": " << emu::last_error_message();
}

// Worst |a - b| / (atol + rtol * |b|) <= 1, with the index of the worst element in the message.
void expect_close(const at::Tensor& actual, const at::Tensor& expected, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const at::Tensor a = actual.to(at::kDouble), b = expected.to(at::kDouble);
  ASSERT_TRUE(at::isfinite(a).all().item<bool>()) << what << ": non-finite output";
  const at::Tensor ratio = (a - b).abs() / (atol + rtol * b.abs());
  const int64_t worst = ratio.flatten().argmax().item<int64_t>();
  EXPECT_LE(ratio.flatten()[worst].item<double>(), 1.0)
      << what << ": element " << worst << " is " << a.flatten()[worst].item<double>() << ", expected "
      << b.flatten()[worst].item<double>();
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kHalf, at::kBFloat16};

// Attention outputs (paged, ragged) against the CPU kernel: float32 accumulation on both sides,
// so one rounding to the output dtype plus the order of the sums.
double attention_rtol(at::ScalarType dtype) {
  return dtype == at::kFloat ? 1e-4 : (dtype == at::kHalf ? 2e-3 : 1.6e-2);
}

// ---- key_norm_scores -------------------------------------------------------------------------

// The head sizes of the issue at float32, every dtype at 128, each with sequence lengths that leave
// a partial last block (and S = 1).
struct DimCase {
  at::ScalarType dtype;
  int64_t dim;
};
// Lane layouts (attention_plan.h's plan_row_lanes): float32 64 (16 lanes of a 16-byte vector), 128 (32
// of one), 256 (32 of two); bfloat16 64 (8 lanes of one vector), 128 (16 of one); half 256 (32 of
// two); 80 and 96 (no whole power-of-two vectors: scalar); 320 (wider than a warp's 8 elements a
// lane: the wide layout).
const std::vector<DimCase> kDimCases = {{at::kFloat, 64},     {at::kFloat, 80},  {at::kFloat, 96},    {at::kFloat, 128},
                                        {at::kFloat, 256},    {at::kFloat, 320}, {at::kBFloat16, 64}, {at::kHalf, 128},
                                        {at::kBFloat16, 128}, {at::kHalf, 256},  {at::kBFloat16, 80}};

TEST(CudaEmulation, KeyNormMatchesTheCpuKernel) {
  for (const DimCase& c : kDimCases) {
    for (const int64_t seq : {1, 33}) {
      const at::Tensor keys = at::randn({2, 3, seq, c.dim}).to(c.dtype);
      at::Tensor out = at::empty({2, 3, seq}, at::kFloat);
      with_cuda_type(c.dtype, [&](auto element) {
        using T = decltype(element);
        expect_launched(
            cu::launch_key_norm_scores<T>(ptr<T>(keys), out.data_ptr<float>(), keys.numel() / c.dim, c.dim, nullptr));
      });
      expect_close(out, kvpress::ops::key_norm_scores(keys), 1e-6, 1e-5,
                   "key_norm dim " + std::to_string(c.dim) + " seq " + std::to_string(seq));
      // The same keys one element past a 16-byte boundary: scalar loads.
      at::Tensor storage = at::empty({keys.numel() + 1}, keys.options());
      const at::Tensor shifted = storage.narrow(0, 1, keys.numel()).view(keys.sizes()).copy_(keys);
      at::Tensor out_shifted = at::empty_like(out);
      with_cuda_type(c.dtype, [&](auto element) {
        using T = decltype(element);
        ASSERT_FALSE(cu::vector_aligned(ptr<T>(shifted)));
        expect_launched(cu::launch_key_norm_scores<T>(ptr<T>(shifted), out_shifted.data_ptr<float>(),
                                                      keys.numel() / c.dim, c.dim, nullptr));
      });
      expect_close(out_shifted, out, 1e-6, 1e-5, "key_norm misaligned dim " + std::to_string(c.dim));
    }
  }
}

// The row layouts the kernels that read a row per group of lanes get (plan_row_lanes).
TEST(CudaEmulation, RowLaneLayouts) {
  const auto layout = [](int64_t dim, int64_t bytes, bool aligned) {
    const cu::LaneRows l = cu::plan_row_lanes(dim, bytes, aligned);
    return std::to_string(l.lanes) + "x" + std::to_string(l.per_lane) + (l.vectors ? " vectors" : " scalar");
  };
  EXPECT_EQ(layout(128, 2, true), "16x8 vectors");
  EXPECT_EQ(layout(128, 4, true), "32x4 vectors");
  EXPECT_EQ(layout(64, 2, true), "8x8 vectors");
  EXPECT_EQ(layout(256, 2, true), "32x8 vectors");
  EXPECT_EQ(layout(128, 2, false), "32x4 scalar");
  EXPECT_EQ(layout(80, 2, true), "32x3 scalar");
  EXPECT_EQ(layout(320, 4, true), "32x0 scalar") << "the wide layout";
}

// ---- keydiff_scores --------------------------------------------------------------------------

TEST(CudaEmulation, KeyDiffMatchesTheCpuKernel) {
  for (const DimCase& c : kDimCases) {
    // 1: one token; 65: a second, partial block of anchor rows (64 rows a block).
    for (const int64_t seq : {1, 65}) {
      const at::Tensor keys = at::randn({1, 2, seq, c.dim}).to(c.dtype);
      const int64_t heads = 2;
      at::Tensor anchor = at::zeros({heads, c.dim}, at::kFloat);
      at::Tensor out = at::empty({1, 2, seq}, at::kFloat);
      with_cuda_type(c.dtype, [&](auto element) {
        using T = decltype(element);
        expect_launched(cu::launch_keydiff_scores<T>(ptr<T>(keys), heads, seq, static_cast<int>(c.dim),
                                                     anchor.data_ptr<float>(), out.data_ptr<float>(), nullptr));
      });
      expect_close(out, kvpress::ops::keydiff_scores(keys), 1e-5, 1e-4,
                   "keydiff dim " + std::to_string(c.dim) + " seq " + std::to_string(seq));
    }
  }
}

// ---- topk_indices, gather_kv -----------------------------------------------------------------

TEST(CudaEmulation, TopkMatchesTheCpuKernelIncludingTies) {
  for (const int64_t seq : {1, 5, 1024, 1500}) {
    for (const int64_t k : {int64_t{1}, (seq + 1) / 2, seq}) {
      // Rounded scores: many ties at the threshold, kept lowest position first.
      const at::Tensor scores = (at::randn({1, 2, seq}) * 4).round();
      at::Tensor out = at::empty({1, 2, k}, at::kLong);
      at::Tensor not_finite = at::zeros({1}, at::kInt);
      expect_launched(cu::launch_topk_rows(scores.const_data_ptr<float>(), 2, seq, k, out.data_ptr<int64_t>(),
                                           not_finite.data_ptr<int>(), nullptr));
      EXPECT_EQ(not_finite.item<int>(), 0);
      EXPECT_TRUE(at::equal(out, kvpress::ops::topk_indices(scores, k))) << "topk seq " << seq << " k " << k;
    }
  }
  const at::Tensor bad = at::tensor({1.f, NAN, 2.f}).reshape({1, 1, 3});
  at::Tensor out = at::empty({1, 1, 1}, at::kLong);
  at::Tensor not_finite = at::zeros({1}, at::kInt);
  expect_launched(cu::launch_topk_rows(bad.const_data_ptr<float>(), 1, 3, 1, out.data_ptr<int64_t>(),
                                       not_finite.data_ptr<int>(), nullptr));
  EXPECT_EQ(not_finite.item<int>(), 1);
}

TEST(CudaEmulation, GatherMatchesTheCpuKernelForEveryWordWidth) {
  for (const at::ScalarType dtype : kDtypes) {
    // dim 7 of a 2-byte type: 2-byte words; 64: 16-byte words; a view offset by one row: 8 or 4.
    for (const int64_t dim : {7, 64, 80}) {
      const at::Tensor keys = at::randn({2, 2, 17, dim}).to(dtype), values = at::randn({2, 2, 17, dim}).to(dtype);
      const at::Tensor indices = at::randint(0, 17, {2, 2, 9}, at::kLong);
      const int64_t row_bytes = dim * keys.element_size();
      at::Tensor keys_out = at::empty({2, 2, 9, dim}, dtype), values_out = at::empty({2, 2, 9, dim}, dtype);
      at::Tensor bad = at::zeros({1}, at::kInt);
      expect_launched(cu::launch_gather_rows(keys.const_data_ptr(), values.const_data_ptr(),
                                             indices.const_data_ptr<int64_t>(), 4, 17, 9, row_bytes,
                                             keys_out.data_ptr(), values_out.data_ptr(), bad.data_ptr<int>(), nullptr));
      EXPECT_EQ(bad.item<int>(), 0);
      const kvpress::KV expected = kvpress::ops::gather_kv(keys, values, indices);
      EXPECT_TRUE(at::equal(keys_out, expected.keys) && at::equal(values_out, expected.values))
          << "gather dim " << dim << " " << dtype;
    }
  }
  const at::Tensor keys = at::randn({1, 1, 4, 8});
  const at::Tensor indices = at::tensor({0, 4, -1}, at::kLong).reshape({1, 1, 3});
  at::Tensor keys_out = at::empty({1, 1, 3, 8}), values_out = at::empty({1, 1, 3, 8});
  at::Tensor bad = at::zeros({1}, at::kInt);
  expect_launched(cu::launch_gather_rows(keys.const_data_ptr(), keys.const_data_ptr(),
                                         indices.const_data_ptr<int64_t>(), 1, 4, 3, 32, keys_out.data_ptr(),
                                         values_out.data_ptr(), bad.data_ptr<int>(), nullptr));
  EXPECT_EQ(bad.item<int>(), 1) << "indices outside [0, seq) are flagged";
}

// ---- paged_attention, paged_write -----------------------------------------------------------

struct PagedCase {
  at::ScalarType dtype;
  int64_t dim, page_size, group, n;
  std::vector<int64_t> lengths;  // per (batch row, KV head), B = lengths.size() / kv_heads
  int64_t kv_heads, sms;         // sms: the device's SM count the split plan sees
};

// A pool of pages handed out in a shuffled order, so that no head's pages are contiguous.
struct PagedLayout {
  at::Tensor key_pool, value_pool, page_table, lengths;
};

PagedLayout make_paged_layout(const PagedCase& c) {
  const int64_t heads = static_cast<int64_t>(c.lengths.size()), batch = heads / c.kv_heads;
  int64_t max_pages = 1, total_pages = 0;
  for (const int64_t len : c.lengths) {
    max_pages = std::max(max_pages, (len + c.page_size - 1) / c.page_size);
    total_pages += (len + c.page_size - 1) / c.page_size;
  }
  const int64_t pool_pages = total_pages + 3;  // a few pages no head uses
  PagedLayout l;
  l.key_pool = at::randn({pool_pages, c.page_size, c.dim}).to(c.dtype);
  l.value_pool = at::randn({pool_pages, c.page_size, c.dim}).to(c.dtype);
  const at::Tensor order = at::randperm(pool_pages, at::kLong);
  l.page_table = at::full({batch, c.kv_heads, max_pages}, -1, at::kLong);
  int64_t next = 0;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t p = 0; p < (c.lengths[h] + c.page_size - 1) / c.page_size; ++p)
      l.page_table[h / c.kv_heads][h % c.kv_heads][p] = order[next++];
  l.lengths = at::tensor(c.lengths, at::kLong).reshape({batch, c.kv_heads});
  return l;
}

TEST(CudaEmulation, PagedAttentionMatchesTheCpuKernel) {
  const std::vector<PagedCase> cases = {
      // head sizes, page sizes 1 / 16 / 64, GQA groups 1 / 4 / 8, ragged lengths, B = 2
      {at::kFloat, 64, 16, 4, 1, {17, 5, 33, 1}, 2, 132},
      {at::kFloat, 80, 1, 1, 2, {9, 3}, 1, 132},
      {at::kFloat, 96, 64, 8, 1, {70, 2}, 1, 132},
      {at::kFloat, 128, 16, 4, 3, {20, 40}, 1, 132},
      {at::kFloat, 256, 16, 1, 1, {31, 16}, 1, 132},
      {at::kHalf, 128, 16, 4, 2, {18, 7}, 1, 132},
      {at::kBFloat16, 128, 16, 4, 2, {18, 7}, 1, 132},
      // many splits: one short unit over 300 keys (3 splits of 100), merged by the reduce kernel
      {at::kFloat, 128, 16, 1, 1, {300}, 1, 132},
      {at::kBFloat16, 64, 64, 4, 1, {260, 130}, 1, 132},
      // one split for the same head when the device is small (4 units fill a 1-SM device)
      {at::kFloat, 128, 16, 4, 1, {300}, 1, 1},
  };
  for (const PagedCase& c : cases) {
    const PagedLayout l = make_paged_layout(c);
    const int64_t batch = l.lengths.size(0), q_heads = c.kv_heads * c.group;
    const at::Tensor queries = at::randn({batch, q_heads, c.n, c.dim}).to(c.dtype);
    const at::Tensor expected =
        kvpress::ops::paged_attention(queries, l.key_pool, l.value_pool, l.page_table, l.lengths);
    at::Tensor out = at::empty_like(queries);
    cu::PagedAttentionShape shape = cu::paged_attention_shape(queries, l.key_pool, l.value_pool, l.page_table,
                                                              1.0 / std::sqrt(static_cast<double>(c.dim)));
    const int64_t units = batch * q_heads * c.n;
    shape.split = cu::plan_attention_splits(units, *std::max_element(c.lengths.begin(), c.lengths.end()), c.sms);
    if (c.sms == 1) EXPECT_EQ(shape.split.count, 1) << "the small-device case must take the one-split path";
    at::Tensor partials = at::empty({units, shape.split.count, cu::split_partial_stride(c.dim)}, at::kFloat);
    at::Tensor errors = at::zeros({1}, at::kInt);
    with_cuda_type(c.dtype, [&](auto element) {
      using T = decltype(element);
      expect_launched(cu::launch_paged_attention<T>(
          ptr<T>(queries), ptr<T>(l.key_pool), ptr<T>(l.value_pool), l.page_table.const_data_ptr<int64_t>(),
          l.lengths.const_data_ptr<int64_t>(), mut<T>(out), partials.data_ptr<float>(), errors.data_ptr<int>(), shape,
          nullptr));
    });
    EXPECT_EQ(errors.item<int>(), 0);
    const double rtol = attention_rtol(c.dtype);
    expect_close(out, expected, c.dtype == at::kFloat ? 1e-5 : rtol, rtol,
                 "paged dim " + std::to_string(c.dim) + " page " + std::to_string(c.page_size) + " group " +
                     std::to_string(c.group) + " splits " + std::to_string(shape.split.count));
  }
}

// The lane layouts of the attention kernels: 16-byte vectors where rows allow, else 32 lanes with
// scalar loads (the cases above run both: fp32 D = 80 and 96 fill no power of two of vectors).
TEST(CudaEmulation, AttentionLaneLayouts) {
  struct Expected {
    int64_t dim, bytes;
    bool aligned;
    int lanes, per_lane;
    bool vectors;
  };
  for (const Expected& e : std::vector<Expected>{{128, 2, true, 16, 8, true},    // bf16 Llama: two keys a warp
                                                 {64, 2, true, 8, 8, true},      // four keys a warp
                                                 {256, 2, true, 32, 8, true},    //
                                                 {128, 4, true, 32, 4, true},    // fp32
                                                 {256, 4, true, 32, 8, true},    // two vectors a lane
                                                 {64, 4, true, 16, 4, true},     //
                                                 {80, 4, true, 32, 3, false},    // 20 vectors: scalar
                                                 {96, 2, true, 32, 3, false},    // 12 vectors: scalar
                                                 {128, 2, false, 32, 4, false},  // rows off the grid
                                                 {4, 2, true, 32, 1, false}}) {  // under one vector
    const cu::LaneRows r = cu::plan_lane_rows(e.dim, e.bytes, e.aligned);
    EXPECT_EQ(r.lanes, e.lanes) << e.dim << " x " << e.bytes;
    EXPECT_EQ(r.per_lane, e.per_lane) << e.dim << " x " << e.bytes;
    EXPECT_EQ(r.vectors, e.vectors) << e.dim << " x " << e.bytes;
    EXPECT_TRUE(cu::valid_lane_rows(r, e.dim)) << e.dim << " x " << e.bytes;
  }
  // The same bf16 launch from queries one element off the 16-byte grid takes the scalar loads and
  // gives the same output.
  const PagedLayout l = make_paged_layout({at::kBFloat16, 128, 16, 4, 1, {40, 7}, 1, 132});
  const at::Tensor storage = at::randn({2 * 4 * 128 + 1}).to(at::kBFloat16);
  const at::Tensor queries = storage.narrow(0, 1, 2 * 4 * 128).view({2, 4, 1, 128});
  at::Tensor outputs[2];
  for (const bool vectors : {true, false}) {
    const at::Tensor q = vectors ? queries.clone() : queries;
    cu::PagedAttentionShape shape = cu::paged_attention_shape(q, l.key_pool, l.value_pool, l.page_table, 0.1);
    ASSERT_EQ(shape.rows.vectors, vectors);
    shape.split = cu::plan_attention_splits(8, 40, 132);
    at::Tensor partials = at::empty({8, shape.split.count, cu::split_partial_stride(128)}, at::kFloat);
    outputs[vectors] = at::empty({2, 4, 1, 128}, at::kBFloat16);
    expect_launched(cu::launch_paged_attention<__nv_bfloat16>(
        ptr<__nv_bfloat16>(q), ptr<__nv_bfloat16>(l.key_pool), ptr<__nv_bfloat16>(l.value_pool),
        l.page_table.const_data_ptr<int64_t>(), l.lengths.const_data_ptr<int64_t>(),
        mut<__nv_bfloat16>(outputs[vectors]), partials.data_ptr<float>(), nullptr, shape, nullptr));
  }
  expect_close(outputs[0], outputs[1], 1e-6, attention_rtol(at::kBFloat16), "scalar against vector loads");
}

TEST(CudaEmulation, PagedWriteMatchesTheCpuKernel) {
  for (const at::ScalarType dtype : kDtypes) {
    for (const int64_t dim : {64, 80}) {
      at::Tensor key_pool = at::randn({5, 16, dim}).to(dtype), value_pool = at::randn({5, 16, dim}).to(dtype);
      at::Tensor key_expected = key_pool.clone(), value_expected = value_pool.clone();
      const at::Tensor keys = at::randn({11, dim}).to(dtype), values = at::randn({11, dim}).to(dtype);
      const at::Tensor slots = at::randperm(80, at::kLong).narrow(0, 0, 11).contiguous();
      kvpress::ops::paged_write(key_expected, value_expected, keys, values, slots);
      with_cuda_type(dtype, [&](auto element) {
        using T = decltype(element);
        expect_launched(cu::launch_paged_write<T>(mut<T>(key_pool), mut<T>(value_pool), ptr<T>(keys), ptr<T>(values),
                                                  slots.const_data_ptr<int64_t>(), 11, dim, 80, nullptr, nullptr));
      });
      EXPECT_TRUE(at::equal(key_pool, key_expected) && at::equal(value_pool, value_expected))
          << "paged_write dim " << dim << " " << dtype;
    }
  }
}

// Tables, lengths and slots the host did not check (a decode step without a synchronisation): the
// kernels read nothing outside the pools and tables (the sanitized stage runs this under
// AddressSanitizer), give the heads with a bad length or page NaN outputs while the other heads'
// outputs stay right, skip rows with a bad slot, and record each kind of error.
TEST(CudaEmulation, PagedKernelsRefuseBadDeviceDataWithoutReadingOutside) {
  const int64_t dim = 64, page_size = 16;
  for (const int64_t sms : {132, 1}) {  // split heads (reduce kernel) and one split
    // Three (batch row, KV head) pairs: a good one, one whose length exceeds its table row, one
    // whose second page lies outside the pool; GQA group 2, n = 1.
    const PagedLayout l = make_paged_layout({at::kFloat, dim, page_size, 2, 1, {300, 40, 40}, 1, sms});
    at::Tensor page_table = l.page_table.clone(), lengths = l.lengths.clone();
    const int64_t max_pages = page_table.size(2), num_pages = l.key_pool.size(0);
    lengths[1][0] = max_pages * page_size + 5;
    page_table[2][0][1] = num_pages + 7;
    const at::Tensor queries = at::randn({3, 2, 1, dim});
    cu::PagedAttentionShape shape = cu::paged_attention_shape(queries, l.key_pool, l.value_pool, page_table, 0.125);
    // Planned from the tables' capacity, as the bridge does when it leaves the lengths on the device.
    shape.split = cu::plan_attention_splits(6, max_pages * page_size, sms);
    at::Tensor out = at::empty_like(queries);
    at::Tensor partials = at::empty({6, shape.split.count, cu::split_partial_stride(dim)}, at::kFloat);
    at::Tensor errors = at::zeros({1}, at::kInt);
    expect_launched(cu::launch_paged_attention<float>(
        ptr<float>(queries), ptr<float>(l.key_pool), ptr<float>(l.value_pool), page_table.const_data_ptr<int64_t>(),
        lengths.const_data_ptr<int64_t>(), mut<float>(out), partials.data_ptr<float>(), errors.data_ptr<int>(), shape,
        nullptr));
    const std::string what = "splits " + std::to_string(shape.split.count);
    EXPECT_EQ(errors.item<int>(), cu::kPagedBadLength | cu::kPagedBadPage) << what;
    EXPECT_TRUE(at::isnan(out.narrow(0, 1, 2)).all().item<bool>()) << what;
    const at::Tensor good =
        kvpress::ops::paged_attention(queries.narrow(0, 0, 1), l.key_pool, l.value_pool, l.page_table.narrow(0, 0, 1),
                                      l.lengths.narrow(0, 0, 1), 0.125);
    expect_close(out.narrow(0, 0, 1), good, 1e-5, attention_rtol(at::kFloat), what + " good head");
  }
  at::Tensor key_pool = at::zeros({5, page_size, dim}), value_pool = at::zeros({5, page_size, dim});
  const at::Tensor keys = at::randn({3, dim}), values = at::randn({3, dim});
  const at::Tensor slots = at::tensor({int64_t{4}, int64_t{80}, int64_t{-1}}, at::kLong);
  at::Tensor errors = at::zeros({1}, at::kInt);
  expect_launched(cu::launch_paged_write<float>(mut<float>(key_pool), mut<float>(value_pool), ptr<float>(keys),
                                                ptr<float>(values), slots.const_data_ptr<int64_t>(), 3, dim, 80,
                                                errors.data_ptr<int>(), nullptr));
  EXPECT_EQ(errors.item<int>(), cu::kPagedBadSlot);
  EXPECT_TRUE(at::equal(key_pool.view({-1, dim})[4], keys[0]) && at::equal(value_pool.view({-1, dim})[4], values[0]));
  EXPECT_EQ(key_pool.abs().sum().item<double>(), keys[0].abs().sum().item<double>()) << "only slot 4 written";
}

// ---- paged_attention_quantized -----------------------------------------------------------------

// The kernel's launch over quantized pages with the plan the bridge makes for `sms` SMs; errors
// into `errors` (nullptr: none recorded).
at::Tensor launch_quantized(const at::Tensor& queries, const kvpress::testing::QuantizedLayout& l,
                            kvpress::KVFormat format, const at::Tensor& page_table, const at::Tensor& lengths,
                            const at::Tensor& residual_slots, int64_t longest, int64_t sms, int* errors) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(queries.size(3)));
  // The arguments as the bridge has them when it leaves the tables on the device.
  const kvpress::checks::QuantizedPagedAttentionArgs a = kvpress::checks::quantized_paged_attention_args(
      queries, l.key_codes, l.key_scales, l.value_codes, l.value_scales, format, page_table, lengths, l.residual_keys,
      l.residual_values, residual_slots, scale, kvpress::checks::IndexContents::kLeaveOnDevice);
  cu::PagedAttentionShape shape = cu::quantized_paged_attention_shape(a.queries, a.key_codes, a.residual_keys,
                                                                      a.residual_values, a.page_table, a.scale);
  const int64_t units = queries.size(0) * queries.size(1) * queries.size(2);
  shape.split = cu::plan_attention_splits(units, longest, sms);
  at::Tensor partials = at::empty({units, shape.split.count, cu::split_partial_stride(shape.dim)}, at::kFloat);
  at::Tensor out = at::empty_like(queries);
  with_cuda_type(queries.scalar_type(), [&](auto element) {
    using T = decltype(element);
    expect_launched(cu::launch_paged_attention_quantized<T>(
        ptr<T>(a.queries), a.pools<T>(a.residual_slots), a.page_table.const_data_ptr<int64_t>(),
        a.lengths.const_data_ptr<int64_t>(), mut<T>(out), partials.data_ptr<float>(), errors, shape, nullptr));
  });
  return out;
}

// Every format against the CPU kernel, which dequantizes by the same formulas (kv_codec.h) and
// exact conversions: what differs is the order of the float32 sums, as for full pages.
TEST(CudaEmulation, QuantizedPagedAttentionMatchesTheCpuKernel) {
  struct Case {
    at::ScalarType dtype;
    int64_t batch, kv_heads, group, n, page_size, dim;
    std::vector<int64_t> lengths;
    int64_t sms;
  };
  const std::vector<Case> cases = {
      // only residual rows, one of them, none, both kinds; fp32 D = 64: 16 lanes of a vector
      {at::kFloat, 2, 2, 3, 1, 16, 64, {1, 17, 32, 40}, 132},
      // bf16 D = 128 (16 lanes of 8), a long head in 6 splits merged by the reduce kernel
      {at::kBFloat16, 1, 4, 2, 1, 16, 128, {700, 16, 15, 300}, 132},
      // n new tokens, no GQA, half D = 80 (scalar lanes), page size 8
      {at::kHalf, 2, 2, 1, 4, 8, 80, {4, 9, 23, 50}, 132},
      // one split on a small device
      {at::kFloat, 1, 1, 4, 1, 16, 128, {300}, 1},
  };
  for (const Case& c : cases) {
    for (const kvpress::KVFormat format :
         {kvpress::KVFormat::kInt8, kvpress::KVFormat::kFp8, kvpress::KVFormat::kInt4}) {
      const kvpress::testing::QuantizedLayout l =
          kvpress::testing::quantized_layout(c.batch, c.kv_heads, c.lengths, c.page_size, c.dim, format, c.dtype, 41);
      const at::Tensor q = kvpress::testing::seeded_randn({c.batch, c.kv_heads * c.group, c.n, c.dim}, 42, c.dtype);
      const at::Tensor expected = kvpress::ops::paged_attention_quantized(
          q, l.key_codes, l.key_scales, l.value_codes, l.value_scales, format, l.page_table, l.lengths, l.residual_keys,
          l.residual_values, l.residual_slots);
      at::Tensor errors = at::zeros({1}, at::kInt);
      const at::Tensor out =
          launch_quantized(q, l, format, l.page_table, l.lengths, l.residual_slots,
                           *std::max_element(c.lengths.begin(), c.lengths.end()), c.sms, errors.data_ptr<int>());
      EXPECT_EQ(errors.item<int>(), 0);
      const double rtol = attention_rtol(c.dtype);
      expect_close(out, expected, c.dtype == at::kFloat ? 1e-5 : rtol, rtol,
                   std::string(kvpress::kv_format_name(format)) + " dim " + std::to_string(c.dim) + " page " +
                       std::to_string(c.page_size) + " " + std::string(c10::toString(c.dtype)));
    }
  }
}

// Lengths, pages and residual slots the host did not check: NaN outputs for the rows they reach,
// right outputs elsewhere, each kind recorded, nothing read outside (AddressSanitizer's stage).
TEST(CudaEmulation, QuantizedPagedAttentionRefusesBadDeviceData) {
  const kvpress::KVFormat format = kvpress::KVFormat::kInt4;
  // Batch rows 0..2, one KV head each, GQA group 2: row 0 good, row 1 a length past its table and a
  // residual slot outside the residual rows, row 2 a page outside the pools.
  const kvpress::testing::QuantizedLayout l =
      kvpress::testing::quantized_layout(3, 1, {40, 40, 40}, 16, 64, format, at::kFloat, 43);
  at::Tensor page_table = l.page_table.clone(), lengths = l.lengths.clone(), slots = l.residual_slots.clone();
  lengths[1][0] = 3 * 16 + 5;
  slots[1] = 9;
  page_table[2][0][1] = l.key_codes.size(0) + 3;
  const at::Tensor q = kvpress::testing::seeded_randn({3, 2, 1, 64}, 44);
  for (const int64_t sms : {132, 1}) {
    at::Tensor errors = at::zeros({1}, at::kInt);
    const at::Tensor out =
        launch_quantized(q, l, format, page_table, lengths, slots, 3 * 16 + 15, sms, errors.data_ptr<int>());
    const std::string what = "sms " + std::to_string(sms);
    EXPECT_EQ(errors.item<int>(), cu::kPagedBadLength | cu::kPagedBadResidual | cu::kPagedBadPage) << what;
    EXPECT_TRUE(at::isnan(out.narrow(0, 1, 2)).all().item<bool>()) << what;
    const at::Tensor good = kvpress::ops::paged_attention_quantized(
        q.narrow(0, 0, 1), l.key_codes, l.key_scales, l.value_codes, l.value_scales, format,
        l.page_table.narrow(0, 0, 1), l.lengths.narrow(0, 0, 1), l.residual_keys, l.residual_values,
        l.residual_slots.narrow(0, 0, 1));
    expect_close(out.narrow(0, 0, 1), good, 1e-5, attention_rtol(at::kFloat), what + " good row");
  }
}

// ---- ragged_attention ------------------------------------------------------------------------

struct RaggedCase {
  at::ScalarType dtype;
  int64_t dim, group, n, m;
  std::vector<int64_t> packed;  // packed rows per (batch row, KV head); B = packed.size() / kv_heads
  int64_t kv_heads, sms = 132;  // sms: the device's SM count the split plan sees
};

TEST(CudaEmulation, RaggedAttentionMatchesTheCpuKernel) {
  const std::vector<RaggedCase> cases = {
      {at::kFloat, 64, 4, 1, 1, {0, 5, 33, 1}, 2},  // a head with no packed rows; S = 1 new token
      {at::kFloat, 80, 1, 2, 3, {9, 3}, 1},
      {at::kFloat, 96, 8, 1, 2, {40, 2}, 1},
      {at::kFloat, 128, 4, 3, 4, {20, 17}, 1},
      {at::kFloat, 256, 1, 1, 1, {31, 16}, 1},
      {at::kHalf, 128, 4, 2, 2, {18, 7}, 1},
      {at::kBFloat16, 128, 4, 2, 2, {18, 7}, 1},
      // long heads split across blocks (150 packed + 120 tail rows: 3 splits of 90, a boundary in
      // the packed rows and one in the tail), merged by the reduce kernel; one split on a small device
      {at::kFloat, 128, 1, 1, 120, {150, 2}, 1},
      {at::kBFloat16, 64, 4, 2, 20, {260, 130}, 1},
      {at::kFloat, 128, 4, 1, 40, {300, 2}, 1, 1},
  };
  for (const RaggedCase& c : cases) {
    const int64_t batch = static_cast<int64_t>(c.packed.size()) / c.kv_heads, q_heads = c.kv_heads * c.group;
    std::vector<int64_t> offsets = {0};
    for (const int64_t rows : c.packed) offsets.push_back(offsets.back() + rows);
    const at::Tensor offsets_t = at::tensor(offsets, at::kLong);
    const at::Tensor packed_keys = at::randn({offsets.back(), c.dim}).to(c.dtype);
    const at::Tensor packed_values = at::randn({offsets.back(), c.dim}).to(c.dtype);
    // The tail as a view of a longer cache (strided along the sequence), as a decoding layer holds it.
    const at::Tensor tail_keys = at::randn({batch, c.kv_heads, c.m + 3, c.dim}).to(c.dtype).narrow(2, 1, c.m);
    const at::Tensor tail_values = at::randn({batch, c.kv_heads, c.m + 2, c.dim}).to(c.dtype).narrow(2, 0, c.m);
    const at::Tensor queries = at::randn({batch, q_heads, c.n, c.dim}).to(c.dtype);
    const at::Tensor expected =
        kvpress::ops::ragged_attention(queries, packed_keys, packed_values, offsets_t, tail_keys, tail_values);
    at::Tensor out = at::empty_like(queries);
    cu::RaggedAttentionShape shape = cu::ragged_attention_shape(
        queries, packed_keys, packed_values, tail_keys, tail_values, 1.0 / std::sqrt(static_cast<double>(c.dim)));
    const int64_t units = batch * q_heads * c.n;
    shape.split = cu::plan_attention_splits(units, *std::max_element(c.packed.begin(), c.packed.end()) + c.m, c.sms);
    if (c.sms == 1) EXPECT_EQ(shape.split.count, 1) << "the small-device case must take the one-split path";
    at::Tensor partials = at::empty({units, shape.split.count, cu::split_partial_stride(c.dim)}, at::kFloat);
    with_cuda_type(c.dtype, [&](auto element) {
      using T = decltype(element);
      expect_launched(cu::launch_ragged_attention<T>(
          ptr<T>(queries), ptr<T>(packed_keys), ptr<T>(packed_values), offsets_t.const_data_ptr<int64_t>(),
          ptr<T>(tail_keys), ptr<T>(tail_values), mut<T>(out), partials.data_ptr<float>(), shape, nullptr));
    });
    const double rtol = attention_rtol(c.dtype);
    expect_close(out, expected, c.dtype == at::kFloat ? 1e-5 : rtol, rtol,
                 "ragged dim " + std::to_string(c.dim) + " group " + std::to_string(c.group) + " n " +
                     std::to_string(c.n) + " splits " + std::to_string(shape.split.count));
  }
}

// ---- lagkv_partition_scores ------------------------------------------------------------------

// The CPU kernel, through the dispatcher (the public LagKV API wraps it in the press's steps).
at::Tensor lagkv_partition_scores(const at::Tensor& keys, const at::Tensor& values, int64_t n_sink, int64_t lag,
                                  bool cross_scoring) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("kvpress::lagkv_partition_scores", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>()
      .call(keys, values, n_sink, lag, cross_scoring);
}

TEST(CudaEmulation, LagKVMatchesTheCpuKernel) {
  struct LagCase {
    at::ScalarType dtype;
    int64_t dim, seq, n_sink, lag;
    bool cross;
  };
  const std::vector<LagCase> cases = {
      {at::kFloat, 64, 40, 4, 8, false},  // a tail shorter than lag after the last partition
      {at::kFloat, 80, 37, 0, 16, true},  // no sink, cross scoring
      {at::kFloat, 128, 64, 4, 20, false},  {at::kFloat, 256, 45, 2, 7, true},
      {at::kHalf, 128, 50, 4, 8, false},    {at::kBFloat16, 128, 50, 4, 8, false},
      {at::kBFloat16, 96, 36, 4, 16, true}, {at::kBFloat16, 64, 40, 4, 8, false},  // 8 lanes a token: 4 tokens a warp
      {at::kFloat, 320, 30, 2, 8, false},                                          // the wide layout
  };
  for (const LagCase& c : cases) {
    const at::Tensor keys = at::randn({1, 2, c.seq, c.dim}).to(c.dtype);
    const at::Tensor values = at::randn({1, 2, c.seq, c.dim}).to(c.dtype);
    const at::Tensor expected = lagkv_partition_scores(keys, values, c.n_sink, c.lag, c.cross);
    at::Tensor out = at::ones({1, 2, c.seq}, at::kFloat);
    const int64_t scored = kvpress::checks::lag_layout(c.seq, c.n_sink, c.lag).n_parts - 1;
    with_cuda_type(c.dtype, [&](auto element) {
      using T = decltype(element);
      expect_launched(cu::launch_lagkv_partition_scores<T>(ptr<T>(keys), ptr<T>(values), 2, c.seq, c.n_sink, c.lag,
                                                           c.dim, c.cross, scored, out.data_ptr<float>(), nullptr));
    });
    const std::string what = "lagkv dim " + std::to_string(c.dim) + " seq " + std::to_string(c.seq) + " lag " +
                             std::to_string(c.lag) + (c.cross ? " cross" : "");
    const double rtol = kvpress::testing::lag_average_rtol(c.dim, c.lag);
    if (c.cross) {
      expect_close(out, expected, 1e-30, rtol, what);  // float32 averages on both sides
      continue;
    }
    // Ranks: the sinks and the unscored tail as the CPU kernel leaves them, and each partition's
    // ranks ordered as the CPU kernel's averages are (near-ties may swap).
    const int64_t scored_end = c.n_sink + scored * c.lag;
    const auto unscored = [&](const at::Tensor& t) {
      return at::cat({t.narrow(-1, 0, c.n_sink), t.narrow(-1, scored_end, c.seq - scored_end)}, -1);
    };
    EXPECT_TRUE(at::equal(unscored(out), unscored(expected))) << what << ": unscored tokens";
    kvpress::testing::expect_lag_ranks_consistent(out, lagkv_partition_scores(keys, values, c.n_sink, c.lag, true),
                                                  c.n_sink, c.lag, scored, c.dtype, rtol, what);
  }
}

// ---- invert_rope, cholesky_leverage ---------------------------------------------------------

// Bit for bit the ATen composite (each product and the difference rounded to the dtype), on every
// dtype, head sizes 64 / 80 / 128 / 256 and a grid the element count does not fill evenly.
TEST(CudaEmulation, InvertRopeMatchesTheCompositeBitForBit) {
  for (const at::ScalarType dtype : kDtypes) {
    for (const int64_t dim : {64, 80, 128, 256}) {
      const auto [cos, sin] = kvpress::testing::rope_tables(33, dim);
      const at::Tensor x = at::randn({2, 3, 33, dim}).to(dtype);
      const at::Tensor expected = kvpress::ops::composite::invert_rope(x, cos, sin);
      const at::Tensor cos_t = cos.to(dtype), sin_t = sin.to(dtype);
      at::Tensor out = at::empty_like(x);
      with_cuda_type(dtype, [&](auto element) {
        using T = decltype(element);
        expect_launched(cu::launch_invert_rope<T>(ptr<T>(x), ptr<T>(cos_t), ptr<T>(sin_t), mut<T>(out), 2 * 3 * 33, 33,
                                                  dim, nullptr));
      });
      EXPECT_TRUE(at::equal(out, expected)) << "invert_rope dim " << dim << " " << dtype;
    }
  }
}

// sketch_prerope_keys' centring on CUDA, for head 1 of keys [2, 3, S, D] (batch rows a head apart):
// with zero means the kernel writes the pre-RoPE keys P themselves, which must equal the composite's
// (float32 un-rotation rounded to the dtype) bit for bit; the means must be P's column means within
// their float32 sum's rounding (S terms of at most max |P|: S * 2^-24 * max |P|) plus one rounding to
// the dtype, and be rounded to it (as ATen's mean in the dtype is); and the centred keys must equal P - means rounded
// to the dtype, bit for bit.
TEST(CudaEmulation, PreropeCentringMatchesTheComposite) {
  for (const at::ScalarType dtype : kDtypes) {
    for (const auto& shape : std::vector<std::pair<int64_t, int64_t>>{{1, 64}, {70, 128}, {33, 80}}) {
      // Plain variables: clang's lambdas cannot capture structured bindings (C++17).
      const int64_t seq = shape.first, dim = shape.second;
      const std::pair<at::Tensor, at::Tensor> tables = kvpress::testing::rope_tables(seq, dim);
      const at::Tensor& cos = tables.first;
      const at::Tensor& sin = tables.second;
      const at::Tensor keys = at::randn({2, 3, seq, dim}).to(dtype);
      const at::Tensor p = kvpress::ops::composite::invert_rope(keys.narrow(1, 1, 1).to(at::kFloat), cos, sin)
                               .to(dtype)
                               .squeeze(1);  // [2, S, D]
      const std::string what = "prerope S " + std::to_string(seq) + " D " + std::to_string(dim);
      at::Tensor zeros = at::zeros({2, dim}), means = at::empty({2, dim}), centred = at::empty({2, seq, dim}, dtype);
      with_cuda_type(dtype, [&](auto element) {
        using T = decltype(element);
        const T* head = ptr<T>(keys) + seq * dim;
        const int64_t stride = 3 * seq * dim;
        expect_launched(cu::launch_prerope_centred<T>(head, stride, cos.const_data_ptr<float>(),
                                                      sin.const_data_ptr<float>(), zeros.const_data_ptr<float>(),
                                                      mut<T>(centred), 2, seq, dim, nullptr));
        EXPECT_TRUE(at::equal(centred, p)) << what << " " << dtype << ": P";
        expect_launched(cu::launch_prerope_column_means<T>(head, stride, cos.const_data_ptr<float>(),
                                                           sin.const_data_ptr<float>(), means.data_ptr<float>(), 2, seq,
                                                           dim, nullptr));
        expect_launched(cu::launch_prerope_centred<T>(head, stride, cos.const_data_ptr<float>(),
                                                      sin.const_data_ptr<float>(), means.const_data_ptr<float>(),
                                                      mut<T>(centred), 2, seq, dim, nullptr));
      });
      const at::Tensor exact = p.to(at::kDouble).mean(1);
      const double sum_error = static_cast<double>(seq) * 0x1p-24 * p.abs().max().item<double>();
      const double ulp = dtype == at::kFloat ? 0x1p-24 : (dtype == at::kHalf ? 0x1p-11 : 0x1p-8);
      expect_close(means, exact, sum_error + 1e-30, ulp, what + " means");
      EXPECT_TRUE(at::equal(means, means.to(dtype).to(at::kFloat))) << what << ": means rounded to " << dtype;
      EXPECT_TRUE(at::equal(centred, (p.to(at::kFloat) - means.unsqueeze(1)).to(dtype))) << what << " " << dtype;
    }
  }
}

// The fused sketch (half, bfloat16; tensor cores through the model's wmma) for head 1 of keys
// [2, 3, S, D], with one Φ for every batch row and with one per batch row. Reference: the centred
// keys C = P - means rounded to the dtype (P the composite's pre-RoPE keys, the means the kernel's
// own, checked above), multiplied by Φ in float64 and rounded to the dtype. The kernel's products
// are exact and its float32 sum of D of them is off by at most D 2^-24 (|C| |Φ|), which may move the
// rounding to the dtype by one unit: |X - reference| <= ulp(X) + D 2^-24 (|C| |Φ|) elementwise;
// and X must be rounded to the dtype, as the composite's GEMM in the dtype writes it.
TEST(CudaEmulation, PreropeSketchMatchesTheCentredProduct) {
  struct Case {
    int64_t seq, dim, k;
  };
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    for (const Case& c : std::vector<Case>{{1, 64, 16}, {70, 128, 48}, {33, 80, 32}, {130, 256, 64}}) {
      for (const bool shared_phi : {true, false}) {
        const std::pair<at::Tensor, at::Tensor> tables = kvpress::testing::rope_tables(c.seq, c.dim);
        const at::Tensor& cos = tables.first;
        const at::Tensor& sin = tables.second;
        const at::Tensor keys = at::randn({2, 3, c.seq, c.dim}).to(dtype);
        const at::Tensor phi = (shared_phi ? at::randn({c.dim, c.k}) : at::randn({2, 3, c.dim, c.k})).to(dtype);
        const at::Tensor p = kvpress::ops::composite::invert_rope(keys.narrow(1, 1, 1).to(at::kFloat), cos, sin)
                                 .to(dtype)
                                 .squeeze(1);  // [2, S, D]
        const cu::PreropeSketchPlan plan = cu::plan_prerope_sketch(2, c.seq, c.dim, c.k, 2, 227 * 1024);
        const std::string what = "prerope sketch S " + std::to_string(c.seq) + " D " + std::to_string(c.dim) + " k " +
                                 std::to_string(c.k) + (shared_phi ? " one phi " : " phi per row ") +
                                 c10::toString(dtype);
        ASSERT_TRUE(plan.applies) << what;
        at::Tensor means = at::empty({2, c.dim}), x = at::empty({2, c.seq, c.k});
        with_cuda_type(dtype, [&](auto element) {
          using T = decltype(element);
          if constexpr (!std::is_same_v<T, float>) {
            const T* head = ptr<T>(keys) + c.seq * c.dim;
            const int64_t stride = 3 * c.seq * c.dim;
            expect_launched(cu::launch_prerope_column_means<T>(head, stride, cos.const_data_ptr<float>(),
                                                               sin.const_data_ptr<float>(), means.data_ptr<float>(), 2,
                                                               c.seq, c.dim, nullptr));
            expect_launched(cu::launch_prerope_sketch<T>(
                head, stride, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), means.const_data_ptr<float>(),
                ptr<T>(phi) + (shared_phi ? 0 : c.dim * c.k), shared_phi ? 0 : 3 * c.dim * c.k, x.data_ptr<float>(),
                c.seq * c.k, c.seq, c.dim, c.k, plan, nullptr));
          }
        });
        const at::Tensor centred = (p.to(at::kFloat) - means.unsqueeze(1)).to(dtype).to(at::kDouble);  // [2, S, D]
        const at::Tensor phi_rows = (shared_phi ? phi.expand({2, c.dim, c.k}) : phi.select(1, 1)).to(at::kDouble);
        const at::Tensor reference = at::bmm(centred, phi_rows).to(dtype).to(at::kDouble);
        const at::Tensor magnitude = at::bmm(centred.abs(), phi_rows.abs());
        const double precision = dtype == at::kHalf ? 10 : 7;
        const at::Tensor ulp = at::exp2(at::floor(at::log2(reference.abs().clamp_min(1e-30))) - precision);
        const at::Tensor excess =
            (x.to(at::kDouble) - reference).abs() - (ulp + static_cast<double>(c.dim) * 0x1p-24 * magnitude);
        EXPECT_LE(excess.max().item<double>(), 0.0) << what;
        EXPECT_TRUE(at::equal(x, x.to(dtype).to(at::kFloat))) << what << ": X rounded to the dtype";
      }
    }
  }
}

// Against the op on the CPU (its kernel or composite), at sketch sizes 16 / 48 (the presses'
// default) / 64 and lengths 1, 65 (a partial second tile) and 200. Both sum in float32 in different
// orders: y_j = (L⁻¹ x)_j has at most k terms, so each is off by about k units of rounding of its
// largest terms; on these random rows (|L⁻¹| |x| at most ~10x |L⁻¹ x|) that bounds the relative
// error of the sum of squares by 2 * 64 * 2^-24 * 10 < 1e-4.
TEST(CudaEmulation, CholeskyLeverageMatchesTheCpuOp) {
  for (const int64_t k : {16, 48, 64}) {
    for (const int64_t seq : {1, 65, 200}) {
      const at::Tensor sketched = at::randn({2, 3, seq, k});
      const at::Tensor factor = (at::randn({2, 3, k, k}) * 0.1).tril() + 2 * at::eye(k);
      const at::Tensor inverse = kvpress::ops::lower_triangular_inverse(factor).contiguous();
      at::Tensor out = at::empty({2, 3, seq});
      expect_launched(cu::launch_cholesky_leverage(sketched.const_data_ptr<float>(), inverse.const_data_ptr<float>(),
                                                   out.data_ptr<float>(), 6, seq, k, nullptr));
      expect_close(out, kvpress::ops::cholesky_leverage(sketched, factor), 1e-6, 1e-4,
                   "cholesky_leverage k " + std::to_string(k) + " seq " + std::to_string(seq));
    }
  }
  EXPECT_EQ(cu::launch_cholesky_leverage(nullptr, nullptr, nullptr, 1, 1, cu::kLeverageMaxSketch + 1, nullptr),
            cudaErrorInvalidValue);
}

// ---- window_attention_mean -------------------------------------------------------------------

// The bridge's composition (src/ops/rope_heads/cuda/window_attention_heads.h) on CPU tensors: the CPU's GEMM in
// place of cuBLAS, then the two kernels through the model.
TEST(CudaEmulation, WindowAttentionMeanMatchesTheCpuKernel) {
  struct WindowCase {
    at::ScalarType dtype;
    int64_t dim, group, window, seq;
  };
  const std::vector<WindowCase> cases = {
      {at::kFloat, 64, 4, 8, 300},  // S - w not a multiple of the 256-thread column block
      {at::kFloat, 128, 1, 1, 2},   // one key before the window
      {at::kFloat, 80, 8, 4, 40},  {at::kHalf, 128, 4, 8, 70}, {at::kBFloat16, 128, 4, 8, 70},
  };
  for (const WindowCase& c : cases) {
    const int64_t batch = 1, kv_heads = 2, heads = kv_heads * c.group;
    const at::Tensor queries = at::randn({batch, heads, c.window, c.dim}).to(c.dtype);
    const at::Tensor keys = at::randn({batch, kv_heads, c.seq, c.dim}).to(c.dtype);
    const at::Tensor expected = kvpress::ops::window_attention_mean(queries, keys);
    at::Tensor out = at::empty({batch, heads, c.seq - c.window}, at::kFloat);
    expect_launched(cu::window_attention_mean_by_heads(queries, keys, out, nullptr));
    expect_close(out, expected, 1e-6, 1e-4,
                 "window mean dim " + std::to_string(c.dim) + " group " + std::to_string(c.group) + " window " +
                     std::to_string(c.window) + " seq " + std::to_string(c.seq));
  }
}

// noncausal_column_sums on the tensor cores (half, bfloat16: wmma, float32 accumulation, logits
// rounded to the dtype as kvpress's GEMM in the dtype rounds them) against the op on the CPU (its
// composite in these dtypes), at every head size, GQA groups 1, 4 and 8, S = 1, S below, at and
// past a chunk, chunks that are not a multiple of 16 (partial key and row tiles) and B > 1.
//
// Inputs on a grid (q in {-7..7}/8, k in {-7..7}/16): every logit is a multiple of 2^-7 below
// 2^24 of them, so both sides' float32 dot products are exact in any order and round to the same
// value of the dtype (most need the rounding: they have more significant bits than bfloat16). What differs is float32
// softmax arithmetic: each exp within an ulp or two on both sides, each row's sum of at most C terms in a different
// order ((C - 1) 2^-24 relative), then the column's sum of at most C positive terms: relative error at most (2 C + 8)
// 2^-24, C = min(chunk, S).
TEST(CudaEmulation, NoncausalColumnSumsMatchTheCpuOp) {
  struct Case {
    int64_t batch, kv_heads, group, seq, dim, chunk;
  };
  const std::vector<Case> cases = {{1, 1, 1, 1, 64, 256},   {2, 2, 4, 70, 80, 32},  {1, 1, 8, 45, 96, 16},
                                   {1, 2, 1, 100, 128, 48}, {1, 1, 1, 33, 256, 24}, {2, 1, 4, 40, 64, 256},
                                   {1, 1, 1, 64, 128, 64}};
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    for (const Case& c : cases) {
      const int64_t heads = c.kv_heads * c.group;
      const at::Tensor queries = (at::randint(-7, 8, {c.batch, heads, c.seq, c.dim}) / 8.0).to(dtype);
      const at::Tensor keys = (at::randint(-7, 8, {c.batch, c.kv_heads, c.seq, c.dim}) / 16.0).to(dtype);
      const at::Tensor expected = kvpress::ops::noncausal_column_sums(queries, keys, c.chunk);
      const cu::NoncausalPlan plan = cu::plan_noncausal(c.batch, heads, c.seq, c.dim, c.chunk, 2, 227 * 1024);
      const std::string what = "noncausal B " + std::to_string(c.batch) + " group " + std::to_string(c.group) + " S " +
                               std::to_string(c.seq) + " D " + std::to_string(c.dim) + " chunk " +
                               std::to_string(c.chunk) + " " + c10::toString(dtype);
      ASSERT_TRUE(plan.applies) << what;
      at::Tensor out = at::empty({c.batch, heads, c.seq});
      with_cuda_type(dtype, [&](auto element) {
        using T = decltype(element);
        if constexpr (!std::is_same_v<T, float>) {
          expect_launched(cu::launch_noncausal_column_sums<T>(
              ptr<T>(queries), queries.stride(0), queries.stride(1), queries.stride(2), ptr<T>(keys), keys.stride(0),
              keys.stride(1), keys.stride(2), out.data_ptr<float>(), c.group, c.seq, c.dim, c.chunk, plan, nullptr));
        }
      });
      const double columns = static_cast<double>(std::min(c.chunk, c.seq));
      expect_close(out, expected, 1e-30, (2 * columns + 8) * 0x1p-24, what);
    }
  }
}

// Gaussian inputs: the two sides' dot products are summed in different orders, so a logit near the
// dtype's rounding boundary may round to a neighbour: off by at most u, one ulp of the dtype at the
// largest |logit|. A row's softmax then moves by a factor within e^(±2u) (numerator and
// denominator), and so does each column's sum, on top of the float32 error above.
TEST(CudaEmulation, NoncausalColumnSumsOnGaussianInputs) {
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    const int64_t batch = 1, kv_heads = 2, group = 4, seq = 90, dim = 128, chunk = 64;
    const at::Tensor queries = at::randn({batch, kv_heads * group, seq, dim}).to(dtype);
    const at::Tensor keys = (at::randn({batch, kv_heads, seq, dim}) / 4).to(dtype);
    const at::Tensor expected = kvpress::ops::noncausal_column_sums(queries, keys, chunk);
    const cu::NoncausalPlan plan = cu::plan_noncausal(batch, kv_heads * group, seq, dim, chunk, 2, 227 * 1024);
    at::Tensor out = at::empty({batch, kv_heads * group, seq});
    with_cuda_type(dtype, [&](auto element) {
      using T = decltype(element);
      if constexpr (!std::is_same_v<T, float>) {
        expect_launched(cu::launch_noncausal_column_sums<T>(
            ptr<T>(queries), queries.stride(0), queries.stride(1), queries.stride(2), ptr<T>(keys), keys.stride(0),
            keys.stride(1), keys.stride(2), out.data_ptr<float>(), group, seq, dim, chunk, plan, nullptr));
      }
    });
    const at::Tensor logits = at::matmul(queries.to(at::kFloat).view({batch, kv_heads, group * seq, dim}),
                                         keys.to(at::kFloat).transpose(2, 3));
    const double largest = logits.abs().max().item<double>();
    const double ulp = std::exp2(std::floor(std::log2(largest)) - (dtype == at::kHalf ? 10 : 7));
    expect_close(out, expected, 1e-30, std::expm1(2 * ulp) + (2 * chunk + 8) * 0x1p-24,
                 std::string("noncausal gaussian ") + c10::toString(dtype));
  }
}

// The plan: the most warps (up to 4, no more than row tiles) whose shared memory fits the device's
// limit; head sizes that are not a multiple of 16 and chunks too wide for shared memory do not apply.
TEST(CudaEmulation, NoncausalPlanFitsSharedMemory) {
  const size_t h200 = 227 * 1024, a100 = 163 * 1024;
  const cu::NoncausalPlan llama = cu::plan_noncausal(1, 32, 16384, 128, 256, 2, h200);
  ASSERT_TRUE(llama.applies);
  EXPECT_EQ(llama.warps, 4);
  EXPECT_EQ(llama.grid.x, 64u);
  EXPECT_EQ(llama.grid.y, 32u);
  EXPECT_LE(llama.shared_bytes, h200);
  const cu::NoncausalPlan wide = cu::plan_noncausal(1, 8, 4096, 256, 256, 2, a100);
  ASSERT_TRUE(wide.applies);
  EXPECT_LT(wide.warps, 4) << "D 256, chunk 256 needs fewer warps within 163 KiB";
  EXPECT_LE(wide.shared_bytes, a100);
  EXPECT_EQ(cu::plan_noncausal(1, 8, 100, 64, 256, 2, h200).width, 112) << "one partial chunk: 100 keys, 7 tiles";
  EXPECT_EQ(cu::plan_noncausal(1, 8, 100, 64, 256, 2, h200).warps, 4);
  EXPECT_EQ(cu::plan_noncausal(1, 8, 20, 64, 256, 2, h200).warps, 2) << "2 row tiles, 2 warps";
  EXPECT_FALSE(cu::plan_noncausal(1, 8, 4096, 72, 256, 2, h200).applies) << "D not a multiple of 16";
  EXPECT_FALSE(cu::plan_noncausal(1, 8, 8192, 256, 2048, 2, h200).applies) << "chunk 2048 x D 256 in shared memory";
  EXPECT_FALSE(cu::plan_noncausal(70000, 8, 64, 64, 256, 2, h200).applies) << "gridDim.z";
}

// The fused sketch's plan: dim and k multiples of 16, its shared memory within the device's limit.
TEST(CudaEmulation, PreropeSketchPlanFitsSharedMemory) {
  const cu::PreropeSketchPlan llama = cu::plan_prerope_sketch(1, 16384, 128, 48, 2, 227 * 1024);
  ASSERT_TRUE(llama.applies);
  EXPECT_EQ(llama.grid.x, 256u);
  EXPECT_LE(llama.shared_bytes, cu::kSharedLimit) << "D 128, k 48 needs no opt-in";
  EXPECT_TRUE(cu::plan_prerope_sketch(1, 100, 256, 64, 2, 163 * 1024).applies);
  EXPECT_FALSE(cu::plan_prerope_sketch(1, 100, 256, 64, 2, 48 * 1024).applies) << "D 256, k 64 above 48 KiB";
  EXPECT_FALSE(cu::plan_prerope_sketch(1, 100, 72, 48, 2, 227 * 1024).applies) << "D not a multiple of 16";
  EXPECT_FALSE(cu::plan_prerope_sketch(1, 100, 128, 40, 2, 227 * 1024).applies) << "k not a multiple of 16";
  EXPECT_FALSE(cu::plan_prerope_sketch(70000, 100, 128, 48, 2, 227 * 1024).applies) << "gridDim.y";
}

// ---- the model itself ------------------------------------------------------------------------

namespace model_checks {

__global__ void racy_block_sum(const float* in, float* out) {
  __shared__ float partial[64];
  partial[threadIdx.x] = in[threadIdx.x];
  // No __syncthreads() here: thread 0 reads what others may not have written yet.
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < 64; ++i) s += partial[i];
    *out = s;
  }
}

__global__ void shuffle_by_half_the_warp(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void barrier_after_early_return(float* out) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

// One 16x16x16 product through wmma: c [16, 16] = a [16, 16] (row-major) x b [16, 16] (column-major).
template <typename T>
__global__ void wmma_product(const T* a, const T* b, float* c, int offset) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.f);
  wmma::load_matrix_sync(fa, a + offset, 16);
  wmma::load_matrix_sync(fb, b, 16);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

// wmma reached by half the warp.
__global__ void wmma_by_half_the_warp(const __half* a, float* c) {
  namespace wmma = nvcuda::wmma;
  if (threadIdx.x >= 16) return;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::load_matrix_sync(fa, a, 16);
  c[threadIdx.x] = __half2float(fa.x[0]);
}

__global__ void write_index(int* out) { out[blockIdx.x * blockDim.x + threadIdx.x] = static_cast<int>(threadIdx.x); }

}  // namespace model_checks

TEST(CudaEmulation, TheModelRefusesWhatTheGpuRefuses) {
  at::Tensor out = at::zeros({2048}, at::kInt);
  KVPRESS_LAUNCH(model_checks::write_index, 2, 1025, 0, nullptr, out.data_ptr<int>());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration) << "more than 1024 threads a block";
  KVPRESS_LAUNCH(model_checks::write_index, 0, 32, 0, nullptr, out.data_ptr<int>());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration) << "an empty grid";
  KVPRESS_LAUNCH(model_checks::write_index, dim3(1, 65536), 32, 0, nullptr, out.data_ptr<int>());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration) << "gridDim.y above 65535";
  KVPRESS_LAUNCH(model_checks::write_index, 1, 32, 48 * 1024 + 1, nullptr, out.data_ptr<int>());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "dynamic shared memory above 48 KiB without the opt-in";
  KVPRESS_LAUNCH(model_checks::write_index, 2, 1024, 0, nullptr, out.data_ptr<int>());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << emu::last_error_message();
  EXPECT_EQ(out[1024 + 1023].item<int>(), 1023);
}

TEST(CudaEmulation, TheModelReportsBrokenCollectives) {
  at::Tensor out = at::zeros({64});
  KVPRESS_LAUNCH(model_checks::shuffle_by_half_the_warp, 1, 32, 0, nullptr, out.data_ptr<float>());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure) << "a full-mask shuffle reached by half the warp";
  EXPECT_NE(emu::last_error_message().find("__shfl_xor_sync"), std::string::npos) << emu::last_error_message();
  KVPRESS_LAUNCH(model_checks::barrier_after_early_return, 1, 64, 0, nullptr, out.data_ptr<float>());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure) << "__syncthreads after part of the block returned";
  EXPECT_NE(emu::last_error_message().find("__syncthreads"), std::string::npos) << emu::last_error_message();
}

// wmma in the model: the product of a 16x16 tile pair equals float32 matmul (exact products, at most
// 16 terms), each lane holding its own elements; a misaligned tile and a partial warp are refused.
TEST(CudaEmulation, TheModelsWmmaMultipliesTilesAndRefusesMisuse) {
  for (const at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    const at::Tensor a = at::randn({16 * 16 + 8}).to(dtype), b = at::randn({16, 16}).to(dtype);
    at::Tensor c = at::empty({16, 16});
    with_cuda_type(dtype, [&](auto element) {
      using T = decltype(element);
      if constexpr (!std::is_same_v<T, float>) {
        KVPRESS_LAUNCH(model_checks::wmma_product<T>, 1, 32, 0, nullptr, ptr<T>(a), ptr<T>(b), c.data_ptr<float>(), 0);
        expect_launched(cudaGetLastError());
        // b is read column-major: element (k, n) at b[n * 16 + k], i.e. bᵀ as a row-major tensor.
        const at::Tensor expected =
            at::matmul(a.narrow(0, 0, 256).view({16, 16}).to(at::kDouble), b.to(at::kDouble).t());
        expect_close(c, expected, 1e-5, 16 * 0x1p-24, std::string("wmma ") + c10::toString(dtype));
        KVPRESS_LAUNCH(model_checks::wmma_product<T>, 1, 32, 0, nullptr, ptr<T>(a), ptr<T>(b), c.data_ptr<float>(), 8);
        EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure) << "a tile 16 bytes past an aligned address";
        EXPECT_NE(emu::last_error_message().find("32-byte aligned"), std::string::npos) << emu::last_error_message();
      }
    });
  }
  const at::Tensor a = at::ones({256}).to(at::kHalf);
  at::Tensor c = at::zeros({32});
  KVPRESS_LAUNCH(model_checks::wmma_by_half_the_warp, 1, 32, 0, nullptr, ptr<__half>(a), c.data_ptr<float>());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure) << "wmma reached by half the warp";
  EXPECT_NE(emu::last_error_message().find("wmma::load_matrix_sync"), std::string::npos) << emu::last_error_message();
}

// Not a check of the kernels but of the model: scripts/test_tsan.sh runs it alone under
// ThreadSanitizer and requires a data-race report (a missing barrier is a real race here). It is
// left out of ctest's discovery; run without ThreadSanitizer it only shows that the launch works.
TEST(CudaEmulationRaceDemo, AMissingBarrierIsARealRace) {
  const at::Tensor in = at::ones({64});
  at::Tensor out = at::zeros({1});
  KVPRESS_LAUNCH(model_checks::racy_block_sum, 1, 64, 0, nullptr, in.const_data_ptr<float>(), out.data_ptr<float>());
  expect_launched(cudaGetLastError());
}

}  // namespace
