// Torch-free CUDA kernels of kvpress::sketch_prerope_keys' centring (prerope_launch.h): the column
// means of the pre-RoPE keys P and the centred P, each computed from the post-RoPE keys on the fly,
// so P itself is never written. The composite instead converts every head to float32, un-rotates it
// through five full-size temporaries, rounds it back and centres it (about 10x the floor); with
// these kernels the bridge reads K twice and writes the centred keys once before cuBLAS sketches
// them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/prerope_launch.h"

namespace kvpress::cuda {

constexpr int kPreropeWarps = 8;
constexpr int64_t kPreropeMaxBlocks = 65535;

// P[s, d] of one unit's rows x ([seq, dim]): float32 un-rotation, each step rounded, then rounded to T.
template <typename T>
__device__ __forceinline__ float prerope_element(const T* __restrict__ x, const float* __restrict__ cos,
                                                 const float* __restrict__ sin, int64_t s, int64_t d, int64_t dim) {
  const int64_t half = dim / 2, e = s * dim + d;
  const float rotated = d < half ? -to_float(x[e + half]) : to_float(x[e - half]);
  const float a = __fmul_rn(to_float(x[e]), cos[e]);
  const float b = __fmul_rn(rotated, sin[e]);
  return round_to<T>(__fsub_rn(a, b));
}

// Block (t, u): the columns [32 t, 32 t + 32) of unit u; lane = column, the warps stride over rows.
template <typename T>
__global__ void prerope_column_means_kernel(const T* __restrict__ keys, int64_t unit_stride,
                                            const float* __restrict__ cos, const float* __restrict__ sin,
                                            float* __restrict__ means, int64_t seq, int64_t dim) {
  __shared__ float partial[kPreropeWarps][kWarpSize];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t unit = blockIdx.y, d = static_cast<int64_t>(blockIdx.x) * kWarpSize + lane;
  const T* x = keys + unit * unit_stride;
  float sum = 0.f;
  if (d < dim)
    for (int64_t s = warp; s < seq; s += kPreropeWarps) sum += prerope_element(x, cos, sin, s, d, dim);
  partial[warp][lane] = sum;
  __syncthreads();
  if (warp != 0 || d >= dim) return;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kPreropeWarps; ++w) total += partial[w][lane];
  means[unit * dim + d] = round_to<T>(total / static_cast<float>(seq));
}

template <typename T>
__global__ void prerope_centred_kernel(const T* __restrict__ keys, int64_t unit_stride, const float* __restrict__ cos,
                                       const float* __restrict__ sin, const float* __restrict__ means,
                                       T* __restrict__ out, int64_t units, int64_t seq, int64_t dim) {
  const int64_t per_unit = seq * dim, elements = units * per_unit;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < elements;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t unit = e / per_unit, s = (e % per_unit) / dim, d = e % dim;
    const float p = prerope_element(keys + unit * unit_stride, cos, sin, s, d, dim);
    out[e] = from_float<T>(__fsub_rn(p, means[unit * dim + d]));
  }
}

template <typename T>
cudaError_t launch_prerope_column_means(const T* keys, int64_t unit_stride, const float* cos, const float* sin,
                                        float* means, int64_t units, int64_t seq, int64_t dim, cudaStream_t stream) {
  if (units == 0 || seq == 0 || dim == 0) return cudaSuccess;
  if (units > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((dim + kWarpSize - 1) / kWarpSize), static_cast<unsigned>(units));
  KVPRESS_LAUNCH(prerope_column_means_kernel<T>, grid, kPreropeWarps * kWarpSize, 0, stream, keys, unit_stride, cos,
                 sin, means, seq, dim);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_prerope_centred(const T* keys, int64_t unit_stride, const float* cos, const float* sin,
                                   const float* means, T* out, int64_t units, int64_t seq, int64_t dim,
                                   cudaStream_t stream) {
  const int64_t elements = units * seq * dim;
  if (elements == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((elements + kThreads - 1) / kThreads, kPreropeMaxBlocks);
  KVPRESS_LAUNCH(prerope_centred_kernel<T>, static_cast<unsigned>(blocks), kThreads, 0, stream, keys, unit_stride, cos,
                 sin, means, out, units, seq, dim);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
