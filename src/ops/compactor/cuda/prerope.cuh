// Torch-free CUDA kernels of kvpress::sketch_prerope_keys' centring (prerope_launch.h): the column
// means of the pre-RoPE keys P and the centred P, each computed from the post-RoPE keys on the fly,
// so P itself is never written; and, for half and bfloat16, the sketch X = (P - means) Φ fused with
// the centring on the tensor cores, so the centred keys are never written either. The composite
// instead converts every head to float32, un-rotates it through five full-size temporaries, rounds
// it back, centres it and sketches it (about 10x the floor); with the fused kernel K is read twice
// (means, sketch) and X written once, the floor.
#pragma once

#if defined(__CUDACC__)
#include <mma.h>
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "compactor/cuda/prerope_launch.h"
#include "cuda/common.cuh"

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

// Block (t, u): rows [64 t, 64 t + 64) of unit u. The block centres its rows into shared memory
// (rows past seq zero) and stages Φ; warp w multiplies rows [16 w, 16 w + 16) by Φ, 16 columns of X
// at a time, and writes them rounded to T.
template <typename T>
__global__ void __launch_bounds__(kPreropeSketchWarps* kWarpSize)
    prerope_sketch_kernel(const T* __restrict__ keys, int64_t unit_stride, const float* __restrict__ cos,
                          const float* __restrict__ sin, const float* __restrict__ means, const T* __restrict__ phi,
                          int64_t phi_unit_stride, float* __restrict__ out, int64_t out_unit_stride, int64_t seq,
                          int64_t dim, int64_t k, PreropeSketchPlan plan) {
  namespace wmma = nvcuda::wmma;
  KVPRESS_DYNAMIC_SHARED(unsigned char, shared);
  T* const rows = reinterpret_cast<T*>(shared);                             // [64][key_stride]
  T* const phi_s = reinterpret_cast<T*>(shared + plan.phi_offset);          // [dim][phi_stride]
  float* const tiles = reinterpret_cast<float*>(shared + plan.out_offset);  // [64][out_stride]
  const int warp = threadIdx.x / kWarpSize;
  const int64_t unit = blockIdx.y, first = static_cast<int64_t>(blockIdx.x) * kPreropeSketchRows;
  const T* x = keys + unit * unit_stride;
  const float* mean = means + unit * dim;
  for (int64_t e = threadIdx.x; e < kPreropeSketchRows * dim; e += blockDim.x) {
    const int64_t r = e / dim, d = e % dim, s = first + r;
    rows[r * plan.key_stride + d] =
        s < seq ? from_float<T>(__fsub_rn(prerope_element(x, cos, sin, s, d, dim), mean[d])) : from_float<T>(0.f);
  }
  const T* phi_u = phi + unit * phi_unit_stride;
  for (int64_t e = threadIdx.x; e < dim * k; e += blockDim.x) phi_s[(e / k) * plan.phi_stride + e % k] = phi_u[e];
  __syncthreads();
  const T* a_rows = rows + warp * 16 * plan.key_stride;
  float* tile = tiles + warp * 16 * plan.out_stride;
  for (int64_t n0 = 0; n0 < k; n0 += 16) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
      wmma::load_matrix_sync(a, a_rows + d0, static_cast<unsigned>(plan.key_stride));
      wmma::load_matrix_sync(b, phi_s + d0 * plan.phi_stride + n0, static_cast<unsigned>(plan.phi_stride));
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(tile + n0, acc, static_cast<unsigned>(plan.out_stride), wmma::mem_row_major);
  }
  __syncthreads();  // the warps' tiles are in shared memory
  float* o = out + unit * out_unit_stride;
  for (int64_t e = threadIdx.x; e < kPreropeSketchRows * k; e += blockDim.x) {
    const int64_t r = e / k, n = e % k, s = first + r;
    if (s < seq) o[s * k + n] = round_to<T>(tiles[r * plan.out_stride + n]);
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

template <typename T>
cudaError_t launch_prerope_sketch(const T* keys, int64_t unit_stride, const float* cos, const float* sin,
                                  const float* means, const T* phi, int64_t phi_unit_stride, float* out,
                                  int64_t out_unit_stride, int64_t seq, int64_t dim, int64_t k,
                                  const PreropeSketchPlan& plan, cudaStream_t stream) {
  if (!plan.applies) return cudaErrorInvalidValue;
  if (plan.shared_bytes > kSharedLimit) {
    const cudaError_t err =
        KVPRESS_SET_MAX_DYNAMIC_SHARED(prerope_sketch_kernel<T>, static_cast<int>(plan.shared_bytes));
    if (err != cudaSuccess) return err;
  }
  KVPRESS_LAUNCH(prerope_sketch_kernel<T>, plan.grid, kPreropeSketchWarps * kWarpSize, plan.shared_bytes, stream, keys,
                 unit_stride, cos, sin, means, phi, phi_unit_stride, out, out_unit_stride, seq, dim, k, plan);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
