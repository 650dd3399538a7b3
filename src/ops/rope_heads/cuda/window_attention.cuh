// Torch-free CUDA kernels of kvpress::window_attention_mean (SnapKVPress, TOVAPress). The bridge
// (window_attention_bridge.cpp) computes one KV head's float32 logits [group * w, S] with cuBLAS; these
// kernels then take each row's causal max and softmax normaliser, and average
// exp(l - max) / sum over the w rows of every query head, column by column (coalesced), straight
// into the output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "rope_heads/cuda/window_attention_launch.h"

namespace kvpress::cuda {

constexpr int kWindowThreads = 256;

// One block per logits row r: window query i = r % window sees keys [0, seq - window + i].
__global__ void window_causal_row_stats(const float* __restrict__ logits,  // [rows, seq]
                                        int64_t seq, int64_t window,
                                        float* __restrict__ row_max,        // [rows]
                                        float* __restrict__ row_inv_sum) {  // [rows]
  __shared__ float scratch[kWarpSize];
  const int64_t r = blockIdx.x;
  const int64_t valid = seq - window + (r % window) + 1;
  const float* l = logits + r * seq;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, l[j]);
  m = block_reduce(m, scratch, true);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += expf(l[j] - m);
  s = block_reduce(s, scratch, false);
  if (threadIdx.x == 0) {
    row_max[r] = m;
    row_inv_sum[r] = 1.f / s;
  }
}

// out[h, j] = mean over the window rows of query head h of softmax(row)[j], for j < seq - window
// (every window row sees those keys). grid: (column blocks, query heads of the KV head).
__global__ void window_column_mean(const float* __restrict__ logits,       // [group * window, seq]
                                   const float* __restrict__ row_max,      // [group * window]
                                   const float* __restrict__ row_inv_sum,  // [group * window]
                                   int64_t seq, int64_t window,
                                   float* __restrict__ out,  // [group, out_row_stride]
                                   int64_t out_row_stride) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t h = blockIdx.y;
  if (j >= seq - window) return;
  float acc = 0.f;
  for (int64_t i = 0; i < window; ++i) {
    const int64_t r = h * window + i;
    acc += expf(logits[r * seq + j] - row_max[r]) * row_inv_sum[r];
  }
  out[h * out_row_stride + j] = acc / static_cast<float>(window);
}

cudaError_t launch_window_mean(const float* logits, int64_t group, int64_t seq, int64_t window, float* row_max,
                               float* row_inv_sum, float* out, int64_t out_row_stride, cudaStream_t stream) {
  const int64_t rows = group * window;
  if (rows == 0 || seq == window) return cudaSuccess;
  if (group > 65535) return cudaErrorInvalidValue;  // gridDim.y
  KVPRESS_LAUNCH(window_causal_row_stats, static_cast<unsigned>(rows), kWindowThreads, 0, stream, logits, seq, window,
                 row_max, row_inv_sum);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((seq - window + kWindowThreads - 1) / kWindowThreads),
                  static_cast<unsigned>(group));
  KVPRESS_LAUNCH(window_column_mean, grid, kWindowThreads, 0, stream, logits, row_max, row_inv_sum, seq, window, out,
                 out_row_stride);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
