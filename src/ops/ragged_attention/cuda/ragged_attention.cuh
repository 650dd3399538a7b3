// Torch-free CUDA kernel: causal attention of n new tokens over a head-ragged layer (see
// kvpress::ops::ragged_attention). The grid is (units, splits), one unit per (batch row, query
// head, new token): block (u, s) attends unit u over its s-th chunk of visible keys (attention_plan.h),
// its warps taking the keys round-robin (a key read by a group of lanes, each holding its part of the
// query and the accumulator, as 16-byte vectors where the rows allow: attention_plan.h). Online
// softmax in float32 per group, then the groups' states are merged through shared memory, into the
// output or the split's partial state that attention_split_reduce merges. GQA: query head q reads KV head q / G;
// nothing is repeated.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/split_attention.cuh"
#include "ragged_attention/cuda/ragged_attention_launch.h"

namespace kvpress::cuda {

template <typename T>
__global__ void ragged_attention_kernel(const T* __restrict__ queries,  // [B, Hq, n, D] contiguous
                                        const T* __restrict__ packed_keys, const T* __restrict__ packed_values,
                                        const int64_t* __restrict__ offsets, const T* __restrict__ tail_keys,
                                        const T* __restrict__ tail_values, T* __restrict__ out,
                                        float* __restrict__ partials,  // [units, splits, D + 2] when splits > 1
                                        RaggedAttentionShape s) {
  __shared__ float part_max[kRaggedWarps * kWarpSize], part_sum[kRaggedWarps * kWarpSize];
  __shared__ float part_acc[kRaggedWarps * kWarpSize * kMaxPerLane];

  const int64_t unit = blockIdx.x, split = blockIdx.y;
  const int64_t i = unit % s.n, bq = unit / s.n, b = bq / s.q_heads, qh = bq % s.q_heads;
  const int64_t h = qh / (s.q_heads / s.kv_heads), bh = b * s.kv_heads + h;

  float q[kMaxPerLane];
  load_lane(queries + unit * s.dim, s.rows, static_cast<int>(threadIdx.x % kWarpSize) % s.rows.lanes, s.dim, q);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) q[t] *= s.scale;
  // Clamped so that bad offsets can never read outside the packed rows (the bridge checks them too).
  int64_t begin = offsets[bh], end = offsets[bh + 1];
  begin = begin < 0 ? 0 : (begin > s.packed_tokens ? s.packed_tokens : begin);
  end = end < begin ? begin : (end > s.packed_tokens ? s.packed_tokens : end);
  const int64_t n_packed = end - begin;
  const int64_t n_visible = n_packed + (s.m - s.n + i + 1);  // packed rows, then tail rows 0..m-n+i
  const T* tail_k = tail_keys + b * s.tk_b + h * s.tk_h;
  const T* tail_v = tail_values + b * s.tv_b + h * s.tv_h;
  const int64_t j_begin = split * s.split.chunk;
  const int64_t j_end = j_begin + s.split.chunk < n_visible ? j_begin + s.split.chunk : n_visible;
  const auto row = [&](int64_t j, const T*& key, const T*& value) {
    key = j < n_packed ? packed_keys + (begin + j) * s.dim : tail_k + (j - n_packed) * s.tk_s;
    value = j < n_packed ? packed_values + (begin + j) * s.dim : tail_v + (j - n_packed) * s.tv_s;
    return true;
  };
  attend_keys<kRaggedWarps, const T*>(s.rows, q, s.dim, j_begin, j_end, row, part_max, part_sum, part_acc);
  __syncthreads();
  finish_split<T>(part_max, part_sum, part_acc, kRaggedWarps * (kWarpSize / s.rows.lanes), s.dim, unit, split,
                  s.split.count, out, partials);
}

template <typename T>
cudaError_t launch_ragged_attention(const T* queries, const T* packed_keys, const T* packed_values,
                                    const int64_t* offsets, const T* tail_keys, const T* tail_values, T* out,
                                    float* partials, const RaggedAttentionShape& shape, cudaStream_t stream) {
  const int64_t units = shape.batch * shape.q_heads * shape.n;
  if (units == 0) return cudaSuccess;
  if (!valid_attention_launch(shape.dim, shape.split, shape.rows)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(shape.split.count));
  KVPRESS_LAUNCH(ragged_attention_kernel<T>, grid, kRaggedWarps * 32, 0, stream, queries, packed_keys, packed_values,
                 offsets, tail_keys, tail_values, out, partials, shape);
  return launch_split_reduce<T>(partials, out, units, shape.dim, shape.split.count, stream);
}

}  // namespace kvpress::cuda
