// Torch-free CUDA kernel of kvpress::lagkv_partition_scores (LagKVPress): one block per (batch, head,
// scored partition p) reads partition p + 1 of K and V for the per-channel min/max, normalises
// partition p by it, takes each token's unbiased std over channels (one warp per token), the
// softmax over the partition in shared memory, the K/V average and, unless cross_scoring, the
// stable rank within the partition (ties to the lower position), rounded to the cache dtype as
// kvpress does. float32 accumulation for every dtype; K and V are read once (plus the reference).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/lane_rows.cuh"
#include "scores/cuda/lagkv_launch.h"

namespace kvpress::cuda {

constexpr int kLagThreads = 256;
constexpr int kLagWarps = kLagThreads / kWarpSize;
// The reference partition's per-column min and 1 / (max - min), into lo[dim] and inv[dim]: a thread
// per column, or, with `column_vectors` (16-byte aligned rows of whole vectors), per 16-byte vector of
// columns.
template <typename T>
__device__ void partition_column_ranges(const T* __restrict__ ref, int lag, int dim, bool column_vectors, float* lo,
                                        float* inv) {
  constexpr int kPerVector = kVectorBytes / static_cast<int>(sizeof(T));
  const int width = column_vectors ? kPerVector : 1;
  for (int d0 = threadIdx.x * width; d0 < dim; d0 += blockDim.x * width) {
    float mn[kPerVector], mx[kPerVector];
    for (int t = 0; t < lag; ++t) {
      const T* row = ref + static_cast<int64_t>(t) * dim + d0;
      alignas(kVectorBytes) T part[kPerVector];
      if (column_vectors)
        *reinterpret_cast<uint4*>(part) = *reinterpret_cast<const uint4*>(row);
      else
        part[0] = row[0];
      for (int u = 0; u < width; ++u) {
        const float v = to_float(part[u]);
        mn[u] = t == 0 ? v : fminf(mn[u], v);
        mx[u] = t == 0 ? v : fmaxf(mx[u], v);
      }
    }
    for (int u = 0; u < width; ++u) {
      lo[d0 + u] = mn[u];
      inv[d0 + u] = 1.f / (mx[u] - mn[u]);
    }
  }
}

// Softmax over the partition's lag per-token stds of one of K/V, into soft[0..lag).
// Shared layout: lo[dim], inv[dim].
// The per-token stds take a group of l.lanes lanes per token (lane_rows.cuh).
template <typename T>
__device__ void partition_softmax(const T* __restrict__ cur, const T* __restrict__ ref, int lag, int dim,
                                  const LaneRows& l, bool column_vectors, float* lo, float* inv, float* soft,
                                  float* scratch) {
  partition_column_ranges(ref, lag, dim, column_vectors, lo, inv);
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, groups = kWarpSize / l.lanes;
  const int lane_in_group = lane % l.lanes;
  // Warp-uniform rounds (the group sums need every lane); group g of warp w takes token base + g.
  for (int base = warp * groups; base < lag; base += kLagWarps * groups) {
    const int t = base + lane / l.lanes;
    const T* x = cur + static_cast<int64_t>(t) * dim;
    float s = 0.f;
    if (t < lag) for_lane_elements(x, l, lane_in_group, dim, [&](int64_t d, float v) { s += (v - lo[d]) * inv[d]; });
    const float mean = group_sum(s, l) / static_cast<float>(dim);
    float q = 0.f;
    if (t < lag) {
      for_lane_elements(x, l, lane_in_group, dim, [&](int64_t d, float v) {
        const float y = (v - lo[d]) * inv[d] - mean;
        q += y * y;
      });
    }
    q = group_sum(q, l);
    if (t < lag && lane_in_group == 0) soft[t] = sqrtf(q / static_cast<float>(dim - 1));  // dim 1: NaN, as torch
  }
  __syncthreads();
  float m = -INFINITY;
  for (int t = threadIdx.x; t < lag; t += blockDim.x) m = fmaxf(m, soft[t]);
  m = block_reduce(m, scratch, true);
  float total = 0.f;
  for (int t = threadIdx.x; t < lag; t += blockDim.x) {
    soft[t] = expf(soft[t] - m);
    total += soft[t];
  }
  total = block_reduce(total, scratch, false);
  for (int t = threadIdx.x; t < lag; t += blockDim.x) soft[t] /= total;
  __syncthreads();
}

// grid: (scored partitions, batch * heads). Shared: lo[dim], inv[dim], soft_k[lag], soft_v[lag].
template <typename T>
__global__ void lagkv_partition_kernel(const T* __restrict__ keys, const T* __restrict__ values, int64_t seq,
                                       int n_sink, int lag, int dim, LaneRows l, bool column_vectors,
                                       bool cross_scoring, float* __restrict__ out) {
  KVPRESS_DYNAMIC_SHARED(float, smem);
  __shared__ float scratch[kWarpSize];
  __shared__ int any_nan;
  float* lo = smem;
  float* inv = lo + dim;
  float* soft_k = inv + dim;
  float* soft_v = soft_k + lag;
  const int64_t row = blockIdx.y, p = blockIdx.x;
  const int64_t part = static_cast<int64_t>(lag) * dim;
  const int64_t base = row * seq * dim + static_cast<int64_t>(n_sink) * dim + p * part;
  if (threadIdx.x == 0) any_nan = 0;
  partition_softmax<T>(keys + base, keys + base + part, lag, dim, l, column_vectors, lo, inv, soft_k, scratch);
  partition_softmax<T>(values + base, values + base + part, lag, dim, l, column_vectors, lo, inv, soft_v, scratch);
  for (int t = threadIdx.x; t < lag; t += blockDim.x) {
    soft_k[t] = (soft_k[t] + soft_v[t]) / 2.f;
    if (isnan(soft_k[t])) any_nan = 1;
  }
  __syncthreads();
  float* dst = out + row * seq + n_sink + p * lag;
  if (cross_scoring || any_nan) {  // NaN ranks would hide bad input from the selection's check
    for (int t = threadIdx.x; t < lag; t += blockDim.x) dst[t] = soft_k[t];
    return;
  }
  for (int t = threadIdx.x; t < lag; t += blockDim.x) {
    const float s = soft_k[t];
    int rank = 0;
    for (int u = 0; u < lag; ++u) {
      const float o = soft_k[u];
      rank += (o < s) || (o == s && u < t);
    }
    dst[t] = round_to<T>(static_cast<float>(rank) / static_cast<float>(lag));
  }
}

template <typename T>
cudaError_t launch_lagkv_partition_scores(const T* keys, const T* values,  // [batch * heads, seq, dim]
                                          int64_t rows, int64_t seq, int64_t n_sink, int64_t lag, int64_t dim,
                                          bool cross_scoring, int64_t scored, float* out, cudaStream_t stream) {
  if (rows == 0 || scored == 0) return cudaSuccess;
  const size_t shared = lagkv_shared_bytes(dim, lag);
  if (shared + kLagStaticShared > kSharedLimit || rows > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(scored), static_cast<unsigned>(rows));
  // Every row the kernel reads starts a multiple of dim elements from keys or values.
  const bool aligned = vector_aligned(keys) && vector_aligned(values);
  const LaneRows l = plan_row_lanes(dim, sizeof(T), aligned);
  const bool column_vectors = aligned && (dim * static_cast<int64_t>(sizeof(T))) % kVectorBytes == 0;
  KVPRESS_LAUNCH(lagkv_partition_kernel<T>, grid, kLagThreads, shared, stream, keys, values, seq,
                 static_cast<int>(n_sink), static_cast<int>(lag), static_cast<int>(dim), l, column_vectors,
                 cross_scoring, out);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
