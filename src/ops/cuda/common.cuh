// Device helpers shared by every CUDA kernel (torch-free): element conversions to and from the
// float32 the kernels accumulate in, and warp/block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "cuda/limits.h"

// A launch, a dynamic shared array and the shared-memory opt-in, as macros so that
// tests/cuda_emulation/cuda_emulation.h can run the same launchers and kernels on the CPU (it defines both before
// including a kernel).
#ifndef KVPRESS_LAUNCH
#define KVPRESS_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  kernel<<<grid, block, shared_bytes, stream>>>(__VA_ARGS__)
#endif
#ifndef KVPRESS_DYNAMIC_SHARED
#define KVPRESS_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif
// The opt-in a kernel needs before a launch with more than 48 KiB of dynamic shared memory.
#ifndef KVPRESS_SET_MAX_DYNAMIC_SHARED
#define KVPRESS_SET_MAX_DYNAMIC_SHARED(kernel, bytes) \
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)
#endif

namespace kvpress::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(v);
  else
    return static_cast<float>(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16(v);
  else
    return static_cast<T>(v);
}

// v as it reads once stored in the element type T (kvpress rounds some scores to the cache dtype).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// Sum / max over a warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Max or sum over the block; every thread gets the result. `scratch`: kWarpSize floats of shared
// memory. Every thread of the block must call it.
__device__ __forceinline__ float block_reduce(float v, float* scratch, bool is_max) {
  v = is_max ? warp_max(v) : warp_sum(v);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = static_cast<int>((blockDim.x + kWarpSize - 1) / kWarpSize);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = is_max ? -INFINITY : 0.f;
  for (int w = 0; w < warps; ++w) r = is_max ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

// Exclusive prefix sum over the block in thread order (threadIdx.x); every thread gets its own.
// `scratch`: kWarpSize int64 of shared memory. Every thread of the block must call it.
__device__ __forceinline__ int64_t block_exclusive_sum(int64_t v, int64_t* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  int64_t inclusive = v;
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == kWarpSize - 1) scratch[warp] = inclusive;
  __syncthreads();
  int64_t before = 0;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  __syncthreads();
  return before + inclusive - v;
}

}  // namespace kvpress::cuda
