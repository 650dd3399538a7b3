// Torch-free CUDA kernel: causal attention of n new tokens over a head-ragged layer (see
// kvpress::ops::ragged_attention). The grid is (units, splits), one unit per (batch row, query
// head, new token): block (u, s) attends unit u over its s-th chunk of visible keys (split_plan.h),
// its warps taking the keys round-robin, each lane holding D / 32 dimensions of the query and of the
// output accumulator. Online softmax in float32 per warp, then the warps' partial results are merged
// through shared memory, into the output or the split's partial state that attention_split_reduce
// merges. GQA: query head q reads KV head q / G; nothing is repeated.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ragged_attention_launch.h"
#include "cuda/split_attention.cuh"

namespace kvpress::cuda {

template <typename T>
__global__ void ragged_attention_kernel(const T* __restrict__ queries,  // [B, Hq, n, D] contiguous
                                        const T* __restrict__ packed_keys, const T* __restrict__ packed_values,
                                        const int64_t* __restrict__ offsets, const T* __restrict__ tail_keys,
                                        const T* __restrict__ tail_values, T* __restrict__ out,
                                        float* __restrict__ partials,  // [units, splits, D + 2] when splits > 1
                                        RaggedAttentionShape s) {
  __shared__ float part_max[kRaggedWarps], part_sum[kRaggedWarps];
  __shared__ float part_acc[kRaggedWarps][kRaggedMaxDim];

  const int64_t unit = blockIdx.x, split = blockIdx.y;
  const int64_t i = unit % s.n, bq = unit / s.n, b = bq / s.q_heads, qh = bq % s.q_heads;
  const int64_t h = qh / (s.q_heads / s.kv_heads), bh = b * s.kv_heads + h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const T* q = queries + unit * s.dim;
  float q_reg[kRaggedMaxDimPerLane], acc[kRaggedMaxDimPerLane];
#pragma unroll
  for (int t = 0; t < kRaggedMaxDimPerLane; ++t) {
    const int64_t d = lane + 32 * t;
    q_reg[t] = d < s.dim ? to_float(q[d]) * s.scale : 0.f;
    acc[t] = 0.f;
  }
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

  float run_max = -INFINITY, run_sum = 0.f;
  for (int64_t j = j_begin + warp; j < j_end; j += kRaggedWarps) {
    const T* k = j < n_packed ? packed_keys + (begin + j) * s.dim : tail_k + (j - n_packed) * s.tk_s;
    const T* v = j < n_packed ? packed_values + (begin + j) * s.dim : tail_v + (j - n_packed) * s.tv_s;
    float dot = 0.f;
#pragma unroll
    for (int t = 0; t < kRaggedMaxDimPerLane; ++t) {
      const int64_t d = lane + 32 * t;
      if (d < s.dim) dot += q_reg[t] * to_float(k[d]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const float new_max = fmaxf(run_max, dot);
    const float correction = __expf(run_max - new_max);  // 0 for the first key
    const float p = __expf(dot - new_max);
    run_sum = run_sum * correction + p;
#pragma unroll
    for (int t = 0; t < kRaggedMaxDimPerLane; ++t) {
      const int64_t d = lane + 32 * t;
      if (d < s.dim) acc[t] = acc[t] * correction + p * to_float(v[d]);
    }
    run_max = new_max;
  }

  if (lane == 0) {
    part_max[warp] = run_max;
    part_sum[warp] = run_sum;
  }
#pragma unroll
  for (int t = 0; t < kRaggedMaxDimPerLane; ++t) {
    const int64_t d = lane + 32 * t;
    if (d < s.dim) part_acc[warp][d] = acc[t];
  }
  __syncthreads();

  finish_split<kRaggedWarps, kRaggedMaxDim>(part_max, part_sum, part_acc, s.dim, unit, split, s.split.count, out,
                                            partials);
}

template <typename T>
cudaError_t launch_ragged_attention(const T* queries, const T* packed_keys, const T* packed_values,
                                    const int64_t* offsets, const T* tail_keys, const T* tail_values, T* out,
                                    float* partials, const RaggedAttentionShape& shape, cudaStream_t stream) {
  const int64_t units = shape.batch * shape.q_heads * shape.n;
  if (units == 0) return cudaSuccess;
  if (shape.dim > kRaggedMaxDim || shape.split.count < 1 || shape.split.count > kMaxSplits)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(shape.split.count));
  KVPRESS_LAUNCH(ragged_attention_kernel<T>, grid, kRaggedWarps * 32, 0, stream, queries, packed_keys, packed_values,
                 offsets, tail_keys, tail_values, out, partials, shape);
  return launch_split_reduce<T>(partials, out, units, shape.dim, shape.split.count, stream);
}

}  // namespace kvpress::cuda
