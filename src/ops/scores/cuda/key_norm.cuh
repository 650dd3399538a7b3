// Torch-free CUDA kernel: scores[row] = -||keys[row, :]||_2 with float32 accumulation.
// A group of lanes per row, 16-byte loads where the layout allows; rows = B * Hkv * S of a contiguous
// [B, Hkv, S, D] tensor.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/lane_rows.cuh"
#include "scores/cuda/key_norm_launch.h"

namespace kvpress::cuda {

// A group of l.lanes lanes per row (lane_rows.cuh): 32 / l.lanes rows a warp.
template <typename T>
__global__ void key_norm_scores_kernel(const T* __restrict__ keys,  // [rows, dim]
                                       float* __restrict__ out,     // [rows]
                                       int64_t rows, int64_t dim, LaneRows l) {
  const int lane = threadIdx.x % kWarpSize, groups = kWarpSize / l.lanes;
  const int64_t first_row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize * groups;
  if (first_row >= rows) return;  // the whole warp: the group sums below need every lane
  const int64_t row = first_row + lane / l.lanes;
  const int lane_in_group = lane % l.lanes;
  float sum = 0.f;
  if (row < rows) for_lane_elements(keys + row * dim, l, lane_in_group, dim, [&](int64_t, float v) { sum += v * v; });
  sum = group_sum(sum, l);
  if (row < rows && lane_in_group == 0) out[row] = -sqrtf(sum);
}

template <typename T>
cudaError_t launch_key_norm_scores(const T* keys,  // [rows, dim] contiguous
                                   float* out,     // [rows]
                                   int64_t rows, int64_t dim, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const LaneRows l = plan_row_lanes(dim, sizeof(T), vector_aligned(keys));
  const int64_t rows_per_block = kThreads / kWarpSize * (kWarpSize / l.lanes);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  KVPRESS_LAUNCH(key_norm_scores_kernel<T>, static_cast<unsigned>(blocks), kThreads, 0, stream, keys, out, rows, dim,
                 l);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
