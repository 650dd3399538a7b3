// Torch-free CUDA kernel: causal attention of n new tokens over a head-ragged layer (see
// kvpress::ops::ragged_attention). One block per (batch row, query head, new token); its warps take
// the visible keys round-robin, each lane holding D / 32 dimensions of the query and of the output
// accumulator. Online softmax in float32 per warp, then the warps' partial results are merged
// through shared memory. GQA: query head q reads KV head q / G; nothing is repeated.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ragged_attention_launch.h"

namespace kvpress::cuda {

template <typename T>
__global__ void ragged_attention_kernel(const T* __restrict__ queries,  // [B, Hq, n, D] contiguous
                                        const T* __restrict__ packed_keys, const T* __restrict__ packed_values,
                                        const int64_t* __restrict__ offsets, const T* __restrict__ tail_keys,
                                        const T* __restrict__ tail_values, T* __restrict__ out,
                                        RaggedAttentionShape s) {
  __shared__ float part_max[kRaggedWarps], part_sum[kRaggedWarps];
  __shared__ float part_acc[kRaggedWarps][kRaggedMaxDim];

  const int64_t unit = blockIdx.x;
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

  float run_max = -INFINITY, run_sum = 0.f;
  for (int64_t j = warp; j < n_visible; j += kRaggedWarps) {
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

  // Merge the warps (a warp that saw no key has max -inf and contributes 0).
  float total_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kRaggedWarps; ++w) total_max = fmaxf(total_max, part_max[w]);
  float total_sum = 0.f;
#pragma unroll
  for (int w = 0; w < kRaggedWarps; ++w) total_sum += part_sum[w] * __expf(part_max[w] - total_max);
  T* o = out + unit * s.dim;
  for (int64_t d = threadIdx.x; d < s.dim; d += blockDim.x) {
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < kRaggedWarps; ++w) value += part_acc[w][d] * __expf(part_max[w] - total_max);
    o[d] = from_float<T>(value / total_sum);
  }
}

template <typename T>
cudaError_t launch_ragged_attention(const T* queries, const T* packed_keys, const T* packed_values,
                                    const int64_t* offsets, const T* tail_keys, const T* tail_values, T* out,
                                    const RaggedAttentionShape& shape, cudaStream_t stream) {
  const int64_t blocks = shape.batch * shape.q_heads * shape.n;
  if (blocks == 0) return cudaSuccess;
  if (shape.dim > kRaggedMaxDim) return cudaErrorInvalidValue;
  KVPRESS_LAUNCH(ragged_attention_kernel<T>, static_cast<unsigned>(blocks), kRaggedWarps * 32, 0, stream, queries,
                 packed_keys, packed_values, offsets, tail_keys, tail_values, out, shape);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
