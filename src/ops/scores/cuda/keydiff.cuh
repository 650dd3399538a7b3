// Torch-free CUDA kernels of KeyDiff: the anchor of every head (sequence mean of the
// L2-normalised keys, eps 1e-12), then -cos(k_i, anchor) with eps 1e-8 on each norm, as
// src/ops/scores/cpu/keydiff.cpp. float32 accumulation; the anchor sums are float atomics, so their order
// (not the formula) differs from the CPU kernel's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/lane_rows.cuh"
#include "scores/cuda/keydiff_launch.h"

namespace kvpress::cuda {

constexpr int kKeyDiffThreads = 256;
constexpr int kKeyDiffWarps = kKeyDiffThreads / kWarpSize;
constexpr int kKeyDiffRowsPerBlock = 64;

// grid: (row blocks of kKeyDiffRowsPerBlock tokens, heads). anchor_sum[h, d] += k[d] / max(||k||, 1e-12).
// A group of l.lanes lanes per token (lane_rows.cuh). Shared: dim floats of block-local sums.
template <typename T>
__global__ void keydiff_anchor_sums(const T* __restrict__ keys,  // [heads, seq, dim]
                                    int64_t seq, int dim, LaneRows l,
                                    float* __restrict__ anchor_sum) {  // [heads, dim], zeroed
  KVPRESS_DYNAMIC_SHARED(float, local);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) local[d] = 0.f;
  __syncthreads();
  const int64_t head = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, groups = kWarpSize / l.lanes;
  const int lane_in_group = lane % l.lanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kKeyDiffRowsPerBlock;
  const int64_t last = first + kKeyDiffRowsPerBlock < seq ? first + kKeyDiffRowsPerBlock : seq;
  // Warp-uniform rounds (the group sums need every lane); group g of warp w takes token base + g.
  for (int64_t base = first + warp * groups; base < last; base += kKeyDiffWarps * groups) {
    const int64_t s = base + lane / l.lanes;
    const T* k = keys + (head * seq + s) * dim;
    float sq = 0.f;
    if (s < last) for_lane_elements(k, l, lane_in_group, dim, [&](int64_t, float v) { sq += v * v; });
    const float inv = 1.f / fmaxf(sqrtf(group_sum(sq, l)), 1e-12f);
    if (s < last)
      for_lane_elements(k, l, lane_in_group, dim, [&](int64_t d, float v) { atomicAdd(&local[d], v * inv); });
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += blockDim.x) atomicAdd(&anchor_sum[head * dim + d], local[d]);
}

// A group of lanes per token: -dot(k, a) / (max(||k||, 1e-8) * max(||a||, 1e-8)), a = anchor_sum / seq.
template <typename T>
__global__ void keydiff_cosine_to_anchor(const T* __restrict__ keys,  // [rows, dim], rows = heads * seq
                                         int64_t rows, int64_t seq, int dim, LaneRows l,
                                         const float* __restrict__ anchor_sum,  // [heads, dim]
                                         float* __restrict__ out) {             // [rows]
  const int lane = threadIdx.x % kWarpSize, groups = kWarpSize / l.lanes;
  const int64_t first_row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize * groups;
  if (first_row >= rows) return;  // the whole warp: the group sums below need every lane
  const int64_t row = first_row + lane / l.lanes;
  const int lane_in_group = lane % l.lanes;
  const float inv_seq = 1.f / static_cast<float>(seq);
  float dot = 0.f, kk = 0.f, aa = 0.f;
  if (row < rows) {
    const float* a = anchor_sum + (row / seq) * dim;
    for_lane_elements(keys + row * dim, l, lane_in_group, dim, [&](int64_t d, float v) {
      const float m = a[d] * inv_seq;
      dot += v * m;
      kk += v * v;
      aa += m * m;
    });
  }
  dot = group_sum(dot, l);
  kk = group_sum(kk, l);
  aa = group_sum(aa, l);
  if (row < rows && lane_in_group == 0) out[row] = -dot / (fmaxf(sqrtf(kk), 1e-8f) * fmaxf(sqrtf(aa), 1e-8f));
}

template <typename T>
cudaError_t launch_keydiff_scores(const T* keys,  // [heads, seq, dim] contiguous
                                  int64_t heads, int64_t seq, int dim,
                                  float* anchor_sum,  // [heads, dim], zeroed
                                  float* out,         // [heads, seq]
                                  cudaStream_t stream) {
  if (heads * seq == 0) return cudaSuccess;
  if (dim > kKeyDiffMaxDim || heads > 65535) return cudaErrorInvalidValue;
  const LaneRows l = plan_row_lanes(dim, sizeof(T), vector_aligned(keys));
  const dim3 grid(static_cast<unsigned>((seq + kKeyDiffRowsPerBlock - 1) / kKeyDiffRowsPerBlock),
                  static_cast<unsigned>(heads));
  KVPRESS_LAUNCH(keydiff_anchor_sums<T>, grid, kKeyDiffThreads, static_cast<size_t>(dim) * sizeof(float), stream, keys,
                 seq, dim, l, anchor_sum);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t rows = heads * seq;
  const int64_t rows_per_block = kKeyDiffWarps * (kWarpSize / l.lanes);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  KVPRESS_LAUNCH(keydiff_cosine_to_anchor<T>, static_cast<unsigned>(blocks), kKeyDiffThreads, 0, stream, keys, rows,
                 seq, dim, l, anchor_sum, out);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
