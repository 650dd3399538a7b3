// Launcher of the LagKV partition kernel (lagkv.cuh), as the host bridge sees it, with its shared
// memory budget. Torch-free and host-compilable; lagkv.cu instantiates it for float, __half and
// __nv_bfloat16.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/limits.h"

namespace kvpress::cuda {

// The kernel's static shared memory (scratch and a flag), which counts against the same limit as
// the dynamic part.
constexpr size_t kLagStaticShared = kWarpSize * sizeof(float) + sizeof(int);

// Dynamic shared memory of one block: lo[dim], inv[dim], soft_k[lag], soft_v[lag].
inline size_t lagkv_shared_bytes(int64_t dim, int64_t lag) {
  return static_cast<size_t>(2 * dim + 2 * lag) * sizeof(float);
}

// grid (scored partitions, batch * heads); out [batch * heads, seq] holds ones where nothing is
// scored. cudaErrorInvalidValue when the block's shared memory exceeds kSharedLimit or rows > 65535.
template <typename T>
cudaError_t launch_lagkv_partition_scores(const T* keys, const T* values,  // [batch * heads, seq, dim]
                                          int64_t rows, int64_t seq, int64_t n_sink, int64_t lag, int64_t dim,
                                          bool cross_scoring, int64_t scored, float* out, cudaStream_t stream);

}  // namespace kvpress::cuda
