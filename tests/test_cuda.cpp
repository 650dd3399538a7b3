// CPU vs CUDA parity for every op with a CUDA kernel. Skipped where no GPU is present.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include "kvpress/ops.h"
#include "test_util.h"

namespace kvpress {
namespace {

#define KVPRESS_REQUIRE_GPU() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine"

TEST(CudaParity, KeyNormScores) {
  KVPRESS_REQUIRE_GPU();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor keys = testing::randn({2, 8, 1000, 128}, 1, dtype);
    const at::Tensor cpu = ops::key_norm_scores(keys);
    const at::Tensor gpu = ops::key_norm_scores(keys.to(at::kCUDA)).cpu();
    EXPECT_TRUE(at::allclose(cpu, gpu, 1e-5, 1e-5)) << dtype;
    // Non-contiguous input takes the same path after a copy.
    const at::Tensor strided = keys.to(at::kCUDA).transpose(1, 2).contiguous().transpose(1, 2);
    EXPECT_TRUE(at::allclose(cpu, ops::key_norm_scores(strided).cpu(), 1e-5, 1e-5)) << dtype;
  }
}

}  // namespace
}  // namespace kvpress
