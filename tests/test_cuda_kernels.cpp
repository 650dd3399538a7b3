// CPU vs CUDA parity of the score and selection kernels of issue 7 (kernels/cuda/*.cu). Skipped
// where no GPU is present or the library was built without CUDA kernels.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <limits>

#include "cuda/kernels.h"
#include "kvpress/ops.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace kvpress {
namespace {

using testing::randn;

#define KVPRESS_REQUIRE_CUDA_KERNELS()                                                  \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";                  \
  if (!kernels::cuda_kernels_built()) GTEST_SKIP() << "libkvpress built without CUDA kernels"

TEST(CudaKernels, WindowAttentionMeanMatchesCpu) {
  KVPRESS_REQUIRE_CUDA_KERNELS();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (int64_t window : {1, 7, 64}) {
      const at::Tensor q = randn({2, 8, window, 64}, 1);
      const at::Tensor k = randn({2, 2, 700, 64}, 2, dtype);
      const at::Tensor cpu = ops::window_attention_mean(q, k);
      const at::Tensor gpu = ops::window_attention_mean(q.cuda(), k.cuda()).cpu();
      // cuBLAS may use TF32 only when allowed; the default (highest precision) keeps float32.
      EXPECT_TRUE(at::allclose(cpu, gpu, 1e-4, 1e-6)) << dtype << " window " << window;
    }
  }
}

TEST(CudaKernels, LagKVScoresMatchCpu) {
  KVPRESS_REQUIRE_CUDA_KERNELS();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor k = randn({2, 4, 4 + 20 * 32 + 5, 128}, 3, dtype);
    const at::Tensor v = randn({2, 4, 4 + 20 * 32 + 5, 128}, 4, dtype);
    const at::Tensor cpu = ops::lagkv_scores(k, v, 4, 32, true);
    const at::Tensor gpu = ops::lagkv_scores(k.cuda(), v.cuda(), 4, 32, true).cpu();
    EXPECT_TRUE(at::allclose(cpu, gpu, 1e-5, 1e-7)) << dtype;
    // Ranks: equal except where two statistics are within rounding of each other.
    const at::Tensor rc = ops::lagkv_scores(k, v, 4, 32, false);
    const at::Tensor rg = ops::lagkv_scores(k.cuda(), v.cuda(), 4, 32, false).cpu();
    const at::Tensor diff = (rc - rg).abs();
    EXPECT_LE(diff.gt(0).sum().item<int64_t>(), rc.numel() / 500 + 2) << dtype;
    EXPECT_LE(diff.max().item<double>(), 3.0 / 32 + 1e-6) << dtype;
  }
}

TEST(CudaKernels, KeyDiffScoresMatchCpu) {
  KVPRESS_REQUIRE_CUDA_KERNELS();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor keys = randn({2, 4, 3000, 128}, 5, dtype);
    const at::Tensor cpu = ops::keydiff_scores(keys);
    const at::Tensor gpu = kernels::keydiff_scores_cuda(keys.cuda()).cpu();
    EXPECT_TRUE(at::allclose(cpu, gpu, 1e-4, 1e-5)) << dtype;
    // The public op gives the same on CUDA, whichever path it takes there.
    EXPECT_TRUE(at::allclose(cpu, ops::keydiff_scores(keys.cuda()).cpu(), 1e-4, 1e-5)) << dtype;
  }
}

TEST(CudaKernels, TopkMatchesCpuIncludingTiesAndSignedZeros) {
  KVPRESS_REQUIRE_CUDA_KERNELS();
  // Few distinct values: many ties at every threshold; -0 and +0 are one value.
  at::Tensor scores = (randn({3, 5, 4099}, 6) * 3).round();
  scores.select(2, 10).fill_(-0.0);
  scores.select(2, 11).fill_(0.0);
  for (int64_t k : {1, 17, 2049, 4098, 4099}) {
    const at::Tensor cpu = ops::topk_indices(scores, k);
    at::Tensor gpu;
    ASSERT_TRUE(kernels::topk_indices_cuda(scores.cuda(), k, gpu)) << k;
    EXPECT_TRUE(at::equal(cpu, gpu.cpu())) << "k " << k;
    EXPECT_TRUE(at::equal(cpu, ops::topk_indices(scores.cuda(), k).cpu())) << "k " << k;
  }
  const at::Tensor distinct = randn({2, 3, 10000}, 7);
  at::Tensor gpu;
  ASSERT_TRUE(kernels::topk_indices_cuda(distinct.cuda(), 5000, gpu));
  EXPECT_TRUE(at::equal(ops::topk_indices(distinct, 5000), gpu.cpu()));
  // bfloat16 scores convert exactly.
  ASSERT_TRUE(kernels::topk_indices_cuda(scores.to(at::kBFloat16).cuda(), 100, gpu));
  EXPECT_TRUE(at::equal(ops::topk_indices(scores, 100), gpu.cpu()));
}

TEST(CudaKernels, TopkRefusesNonFiniteScores) {
  KVPRESS_REQUIRE_CUDA_KERNELS();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    at::Tensor scores = randn({1, 2, 100}, 8);
    scores[0][1][50] = bad;
    at::Tensor out;
    EXPECT_FALSE(kernels::topk_indices_cuda(scores.cuda(), 10, out)) << bad;
  }
}

TEST(CudaKernels, GatherRowsMatchesCpu) {
  KVPRESS_REQUIRE_CUDA_KERNELS();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (int64_t dim : {128, 7}) {  // 7 * 2 bytes: the narrowest copy word
      const at::Tensor keys = randn({2, 3, 500, dim}, 9, dtype);
      const at::Tensor values = randn({2, 3, 500, dim}, 10, dtype);
      const at::Tensor idx = std::get<0>(at::randperm(500, at::kLong).narrow(0, 0, 123).sort())
                                 .expand({2, 3, 123})
                                 .contiguous();
      const KV cpu = ops::gather_kv(keys, values, idx);
      at::Tensor k_out, v_out;
      EXPECT_EQ(kernels::gather_rows_cuda(keys.cuda(), values.cuda(), idx.cuda(), k_out, v_out), -1);
      EXPECT_TRUE(at::equal(cpu.keys, k_out.cpu())) << dtype << " dim " << dim;
      EXPECT_TRUE(at::equal(cpu.values, v_out.cpu())) << dtype << " dim " << dim;
      const KV via_op = ops::gather_kv(keys.cuda(), values.cuda(), idx.cuda());
      EXPECT_TRUE(at::equal(cpu.keys, via_op.keys.cpu()));
    }
  }
  const at::Tensor keys = randn({1, 1, 10, 4}, 11);
  at::Tensor k_out, v_out;
  EXPECT_GE(kernels::gather_rows_cuda(keys.cuda(), keys.cuda(), at::full({1, 1, 2}, 10, at::kLong).cuda(), k_out, v_out),
            0);
}

// Whole presses on CUDA tensors keep what they keep on CPU.
TEST(CudaKernels, PressesKeepTheSamePositionsOnCuda) {
  KVPRESS_REQUIRE_CUDA_KERNELS();
  LayerInputs in;
  in.keys = randn({1, 4, 2000, 64}, 12);
  in.values = randn({1, 4, 2000, 64}, 13);
  in.queries = randn({1, 16, 2000, 64}, 14);
  LayerInputs gpu = in;
  gpu.keys = in.keys.cuda();
  gpu.values = in.values.cuda();
  gpu.queries = in.queries.cuda();
  for (const char* name : {"SnapKVPress", "TOVAPress", "LagKVPress", "KeyDiffPress", "KnormPress"}) {
    const auto press = make_press(name, 0.5);
    const KV c = press->compress(in);
    const KV g = press->compress(gpu);
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
