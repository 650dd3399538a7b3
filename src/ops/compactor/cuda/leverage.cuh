// Torch-free CUDA kernel of kvpress::cholesky_leverage (LeverageScorePress, CompactorPress): the
// leverage score of every sketched row, ℓ_i = ||L⁻¹ x_i||², in one pass over the [S, k] rows, where
// the ATen composite writes the [S, k] product, its square and then sums it (about 5x the op's
// read-once floor). Block (t, u) stages L⁻¹ of unit u and its t-th tile of kLeverageRows rows in
// shared memory (coalesced loads); each thread then forms one row's y = L⁻¹ x (lower triangular:
// y_j needs x_0..x_j) and sums its squares, in float32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "compactor/cuda/leverage_launch.h"
#include "cuda/common.cuh"

namespace kvpress::cuda {

__global__ void cholesky_leverage_kernel(const float* __restrict__ sketched, const float* __restrict__ inverse,
                                         float* __restrict__ out, int64_t seq, int k) {
  KVPRESS_DYNAMIC_SHARED(float, smem);
  float* inv = smem;           // [k, k]
  float* rows = smem + k * k;  // [kLeverageRows, k + 1]
  const int64_t unit = blockIdx.y, first = static_cast<int64_t>(blockIdx.x) * kLeverageRows;
  const int64_t n_rows = seq - first < kLeverageRows ? seq - first : kLeverageRows;
  const float* l_inv = inverse + unit * k * k;
  for (int e = threadIdx.x; e < k * k; e += blockDim.x) inv[e] = l_inv[e];
  const float* x = sketched + (unit * seq + first) * k;
  for (int64_t e = threadIdx.x; e < n_rows * k; e += blockDim.x) rows[(e / k) * (k + 1) + e % k] = x[e];
  __syncthreads();
  if (threadIdx.x >= n_rows) return;
  const float* r = rows + threadIdx.x * (k + 1);
  float total = 0.f;
  for (int j = 0; j < k; ++j) {
    float y = 0.f;
    for (int l = 0; l <= j; ++l) y += inv[j * k + l] * r[l];
    total += y * y;
  }
  out[unit * seq + first + threadIdx.x] = total;
}

cudaError_t launch_cholesky_leverage(const float* sketched, const float* inverse, float* out, int64_t units,
                                     int64_t seq, int64_t k, cudaStream_t stream) {
  if (units == 0 || seq == 0) return cudaSuccess;
  if (k < 1 || k > kLeverageMaxSketch || units > kLeverageMaxUnits) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((seq + kLeverageRows - 1) / kLeverageRows), static_cast<unsigned>(units));
  KVPRESS_LAUNCH(cholesky_leverage_kernel, grid, kLeverageRows, leverage_shared_bytes(k), stream, sketched, inverse,
                 out, seq, static_cast<int>(k));
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
