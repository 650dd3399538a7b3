// Torch-free CUDA kernel: scores[row] = -||keys[row, :]||_2 with float32 accumulation.
// One warp per row; rows = B * Hkv * S of a contiguous [B, Hkv, S, D] tensor.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kvpress::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__global__ void key_norm_scores_kernel(const T* __restrict__ keys, float* __restrict__ out,
                                       int64_t rows, int64_t dim) {
  constexpr int kWarp = 32;
  const int64_t warp_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp_id >= rows) return;
  const T* k = keys + warp_id * dim;
  float sum = 0.f;
  for (int64_t d = lane; d < dim; d += kWarp) {
    const float v = to_float(k[d]);
    sum += v * v;
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (lane == 0) out[warp_id] = -sqrtf(sum);
}

template <typename T>
cudaError_t launch_key_norm_scores(const T* keys, float* out, int64_t rows, int64_t dim,
                                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  constexpr int kWarpsPerBlock = kThreads / 32;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  key_norm_scores_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(keys, out, rows, dim);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
