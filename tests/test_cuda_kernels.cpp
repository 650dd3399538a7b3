// CPU vs CUDA parity of every op with a CUDA kernel (src/ops/<family>/cuda/*.cu), called through the
// dispatcher as users call them. The CPU half runs everywhere; the CUDA half is skipped where no GPU
// is present or the library was built without CUDA kernels (CUDA tensors then take the ATen
// composites). tests/test_cuda_emulation.cpp runs the same kernels on every machine.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "compactor/compactor.h"
#include "kvpress/ops.h"
#include "kvpress/registry.h"
#include "paged/paged.h"
#include "ragged_attention/ragged_attention.h"
#include "rope_heads/rope_heads.h"
#include "scores/scores.h"
#include "selection/selection.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::randn;

TEST(CudaKernels, KeyNormScoresMatchCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor keys = randn({2, 8, 1000, 128}, 1, dtype);
    const at::Tensor cpu = ops::key_norm_scores(keys);
    if (!no_cuda.empty()) continue;
    const at::Tensor gpu = ops::key_norm_scores(keys.to(at::kCUDA)).cpu();
    EXPECT_TRUE(at::allclose(cpu, gpu, 1e-5, 1e-5)) << dtype;
    // Non-contiguous input takes the same path after a copy.
    const at::Tensor strided = keys.to(at::kCUDA).transpose(1, 2).contiguous().transpose(1, 2);
    EXPECT_TRUE(at::allclose(cpu, ops::key_norm_scores(strided).cpu(), 1e-5, 1e-5)) << dtype;
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(CudaKernels, WindowAttentionMeanMatchesCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (int64_t window : {1, 7, 64}) {
      const at::Tensor q = randn({2, 8, window, 64}, 1);
      const at::Tensor k = randn({2, 2, 700, 64}, 2, dtype);
      const at::Tensor cpu = ops::window_attention_mean(q, k);
      if (!no_cuda.empty()) continue;
      const at::Tensor gpu = ops::window_attention_mean(q.cuda(), k.cuda()).cpu();
      // cuBLAS may use TF32 only when allowed; the default (highest precision) keeps float32.
      EXPECT_TRUE(at::allclose(cpu, gpu, 1e-4, 1e-6)) << dtype << " window " << window;
    }
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(CudaKernels, LagKVScoresMatchCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  constexpr int64_t n_sink = 4, lag = 32, dim = 128;
  const checks::LagLayout layout = checks::lag_layout(4 + 20 * lag + 5, n_sink, lag);
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor k = randn({2, 4, 4 + 20 * lag + 5, dim}, 3, dtype);
    const at::Tensor v = randn({2, 4, 4 + 20 * lag + 5, dim}, 4, dtype);
    const at::Tensor cpu = ops::lagkv_scores(k, v, n_sink, lag, true);
    const at::Tensor rc = ops::lagkv_scores(k, v, n_sink, lag, false);
    if (!no_cuda.empty()) continue;
    const double rtol = testing::lag_average_rtol(dim, lag);
    const at::Tensor gpu = ops::lagkv_scores(k.cuda(), v.cuda(), n_sink, lag, true).cpu();
    EXPECT_TRUE(at::allclose(gpu, cpu, rtol, 1e-30)) << dtype;
    // Ranks: the sinks and the last partition with the tail as on the CPU, and each scored
    // partition's ranks ordered as the CPU's averages are (near-ties may swap).
    const at::Tensor rg = ops::lagkv_scores(k.cuda(), v.cuda(), n_sink, lag, false).cpu();
    const int64_t scored_end = layout.end - lag;
    EXPECT_TRUE(at::equal(rg.narrow(2, 0, n_sink), rc.narrow(2, 0, n_sink))) << dtype;
    EXPECT_TRUE(
        at::equal(rg.narrow(2, scored_end, rg.size(2) - scored_end), rc.narrow(2, scored_end, rc.size(2) - scored_end)))
        << dtype;
    testing::expect_lag_ranks_consistent(rg, cpu, n_sink, lag, layout.n_parts - 1, dtype, rtol,
                                         "lagkv " + std::string(c10::toString(dtype)));
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(CudaKernels, InvertRopeMatchesCpuBitForBit) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  const auto [cos, sin] = testing::rope_tables(1000, 128, 500000.0);
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor x = randn({2, 8, 1000, 128}, 11, dtype);
    const at::Tensor cpu = ops::invert_rope(x, cos, sin);
    if (!no_cuda.empty()) continue;
    EXPECT_TRUE(at::equal(cpu, ops::invert_rope(x.cuda(), cos.cuda(), sin.cuda()).cpu())) << dtype;
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

// The centring kernels and the composite's sketch against the CPU: X and the Gram matrix in float32
// from GEMMs in the cache dtype on both sides; bfloat16 keys round the centred keys and X to 8 bits.
TEST(CudaKernels, SketchPreropeKeysMatchesCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  const auto [cos, sin] = testing::rope_tables(700, 128, 500000.0);
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {  // half, bfloat16: the fused sketch
    const at::Tensor keys = randn({2, 4, 700, 128}, 14, dtype), sketch = randn({128, 48}, 15, dtype);
    const auto [x, gram] = ops::sketch_prerope_keys(keys, cos, sin, sketch);
    if (!no_cuda.empty()) continue;
    const auto [xg, gramg] = ops::sketch_prerope_keys(keys.cuda(), cos.cuda(), sin.cuda(), sketch.cuda());
    const double tol = dtype == at::kFloat ? 1e-4 : 2e-2;
    EXPECT_TRUE(at::allclose(xg.cpu(), x, tol, tol)) << dtype;
    EXPECT_TRUE(at::allclose(gramg.cpu(), gram, tol, tol * gram.abs().max().item<double>())) << dtype;
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

// The tensor-core kernel (half, bfloat16) and the composite (float32) against the CPU, on grid
// inputs whose logits are exact in float32 in any order; the tolerance is the float32 softmax and
// sums' (tests/test_cuda_emulation.cpp, NoncausalColumnSumsMatchTheCpuOp), C = 256. 600 positions:
// two whole chunks and a padded one.
TEST(CudaKernels, NoncausalColumnSumsMatchCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    at::manual_seed(16);
    const at::Tensor queries = (at::randint(-7, 8, {2, 16, 600, 128}) / 8.0).to(dtype);
    const at::Tensor keys = (at::randint(-7, 8, {2, 4, 600, 128}) / 16.0).to(dtype);
    const at::Tensor cpu = ops::noncausal_column_sums(queries, keys, 256);
    if (!no_cuda.empty()) continue;
    const at::Tensor gpu = ops::noncausal_column_sums(queries.cuda(), keys.cuda(), 256).cpu();
    EXPECT_TRUE(at::allclose(gpu, cpu, (2 * 256 + 8) * 0x1p-24, 1e-30)) << dtype;
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

// Tolerance: tests/test_cuda_emulation.cpp, CholeskyLeverageMatchesTheCpuOp.
TEST(CudaKernels, CholeskyLeverageMatchesCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (const int64_t k : {48, 96}) {  // the kernel's sketch sizes, and the composite beyond them
    const at::Tensor sketched = randn({2, 8, 3000, k}, 12);
    const at::Tensor factor = (randn({2, 8, k, k}, 13) * 0.1).tril() + 2 * at::eye(k);
    const at::Tensor cpu = ops::cholesky_leverage(sketched, factor);
    if (!no_cuda.empty()) continue;
    const at::Tensor gpu = ops::cholesky_leverage(sketched.cuda(), factor.cuda()).cpu();
    EXPECT_TRUE(at::allclose(gpu, cpu, 1e-4, 1e-6)) << "k " << k;
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(CudaKernels, KeyDiffScoresMatchCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor keys = randn({2, 4, 3000, 128}, 5, dtype);
    const at::Tensor cpu = ops::keydiff_scores(keys);
    if (!no_cuda.empty()) continue;
    const at::Tensor gpu = ops::keydiff_scores(keys.cuda()).cpu();
    EXPECT_TRUE(at::allclose(cpu, gpu, 1e-4, 1e-5)) << dtype;
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(CudaKernels, TopkMatchesCpuIncludingTiesAndSignedZeros) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  // Few distinct values: many ties at every threshold; -0 and +0 are one value.
  at::Tensor scores = (randn({3, 5, 4099}, 6) * 3).round();
  scores.select(2, 10).fill_(-0.0);
  scores.select(2, 11).fill_(0.0);
  const at::Tensor distinct = randn({2, 3, 10000}, 7);
  for (int64_t k : {1, 17, 2049, 4098, 4099}) {
    const at::Tensor cpu = ops::topk_indices(scores, k);
    if (!no_cuda.empty()) continue;
    EXPECT_TRUE(at::equal(cpu, ops::topk_indices(scores.cuda(), k).cpu())) << "k " << k;
  }
  const at::Tensor cpu_distinct = ops::topk_indices(distinct, 5000), cpu_100 = ops::topk_indices(scores, 100);
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
  EXPECT_TRUE(at::equal(cpu_distinct, ops::topk_indices(distinct.cuda(), 5000).cpu()));
  // bfloat16 scores convert exactly; float64 ones take the composite.
  EXPECT_TRUE(at::equal(cpu_100, ops::topk_indices(scores.to(at::kBFloat16).cuda(), 100).cpu()));
  EXPECT_TRUE(at::equal(cpu_100, ops::topk_indices(scores.to(at::kDouble).cuda(), 100).cpu()));
}

TEST(CudaKernels, TopkRefusesNonFiniteScores) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    at::Tensor scores = randn({1, 2, 100}, 8);
    scores[0][1][50] = bad;
    testing::expect_error([&] { ops::topk_indices(scores, 10); }, {"topk_indices: scores must be finite, got 1 "});
    if (!no_cuda.empty()) continue;
    testing::expect_error([&] { ops::topk_indices(scores.cuda(), 10); },
                          {"topk_indices: scores must be finite, got 1 "});
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(CudaKernels, GatherRowsMatchesCpu) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (int64_t dim : {128, 7}) {  // 7 * 2 bytes: the narrowest copy word
      const at::Tensor keys = randn({2, 3, 500, dim}, 9, dtype);
      const at::Tensor values = randn({2, 3, 500, dim}, 10, dtype);
      const at::Tensor idx =
          std::get<0>(at::randperm(500, at::kLong).narrow(0, 0, 123).sort()).expand({2, 3, 123}).contiguous();
      const KV cpu = ops::gather_kv(keys, values, idx);
      if (!no_cuda.empty()) continue;
      const KV gpu = ops::gather_kv(keys.cuda(), values.cuda(), idx.cuda());
      EXPECT_TRUE(at::equal(cpu.keys, gpu.keys.cpu())) << dtype << " dim " << dim;
      EXPECT_TRUE(at::equal(cpu.values, gpu.values.cpu())) << dtype << " dim " << dim;
    }
  }
  const at::Tensor keys = randn({1, 1, 10, 4}, 11);
  const std::string out_of_range = "gather_kv: indices must be in [0, seq_len (10)), got values in [10, 10]";
  testing::expect_error([&] { ops::gather_kv(keys, keys, at::full({1, 1, 2}, 10, at::kLong)); }, {out_of_range});
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
  testing::expect_error(
      [&] {
        ops::gather_kv(keys.cuda(), keys.cuda(), at::full({1, 1, 2}, 10, at::kLong).cuda());
      },
      {out_of_range});
}

// Whole presses on CUDA tensors keep what they keep on CPU.
TEST(CudaKernels, PressesKeepTheSamePositionsOnCuda) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  LayerInputs in;
  in.keys = randn({1, 4, 2000, 64}, 12);
  in.values = randn({1, 4, 2000, 64}, 13);
  in.queries = randn({1, 16, 2000, 64}, 14);
  const std::vector<const char*> names = {"SnapKVPress", "TOVAPress", "LagKVPress", "KeyDiffPress", "KnormPress"};
  std::vector<KV> on_cpu;
  for (const char* name : names) on_cpu.push_back(make_press(name, 0.5)->compress(in));
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
  LayerInputs gpu = in;
  gpu.keys = in.keys.cuda();
  gpu.values = in.values.cuda();
  gpu.queries = in.queries.cuda();
  for (size_t i = 0; i < names.size(); ++i) {
    const char* name = names[i];
    const KV& c = on_cpu[i];
    const KV g = make_press(name, 0.5)->compress(gpu);
    const auto kept_mask = [&](const at::Tensor& idx) {
      return at::zeros({1, 4, 2000}, at::kInt).scatter_(2, idx.cpu(), 1);
    };
    const double agree = (kept_mask(c.kept_indices) * kept_mask(g.kept_indices)).sum().item<double>() /
                         static_cast<double>(c.kept_indices.numel());
    EXPECT_GE(agree, 0.995) << name;  // near-ties at the threshold may flip
  }
}

}  // namespace
}  // namespace kvpress
