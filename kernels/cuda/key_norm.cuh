// Torch-free CUDA kernel: scores[row] = -||keys[row, :]||_2 with float32 accumulation.
// One warp per row; rows = B * Hkv * S of a contiguous [B, Hkv, S, D] tensor.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/key_norm_launch.h"

namespace kvpress::cuda {

template <typename T>
__global__ void key_norm_scores_kernel(const T* __restrict__ keys,  // [rows, dim]
                                       float* __restrict__ out,     // [rows]
                                       int64_t rows, int64_t dim) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;
  const T* k = keys + row * dim;
  float sum = 0.f;
  for (int64_t d = lane; d < dim; d += kWarpSize) {
    const float v = to_float(k[d]);
    sum += v * v;
  }
  sum = warp_sum(sum);
  if (lane == 0) out[row] = -sqrtf(sum);
}

template <typename T>
cudaError_t launch_key_norm_scores(const T* keys,  // [rows, dim] contiguous
                                   float* out,     // [rows]
                                   int64_t rows, int64_t dim, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  constexpr int kRowsPerBlock = kThreads / kWarpSize;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  KVPRESS_LAUNCH(key_norm_scores_kernel<T>, static_cast<unsigned>(blocks), kThreads, 0, stream, keys, out, rows, dim);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
