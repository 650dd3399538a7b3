// Launcher of the KeyDiff kernels (keydiff.cuh), as the host bridge sees it. Torch-free and
// host-compilable; keydiff.cu instantiates it for float, __half and __nv_bfloat16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/limits.h"

namespace kvpress::cuda {

// Largest head_dim whose block-local anchor fits the default dynamic shared memory.
constexpr int64_t kKeyDiffMaxDim = kSharedLimit / sizeof(float);

// out[h, i] = -cos(keys[h, i], anchor of head h); cudaErrorInvalidValue when dim > kKeyDiffMaxDim
// or heads > 65535.
template <typename T>
cudaError_t launch_keydiff_scores(const T* keys,  // [heads, seq, dim] contiguous
                                  int64_t heads, int64_t seq, int dim,
                                  float* anchor_sum,  // [heads, dim], zeroed
                                  float* out,         // [heads, seq]
                                  cudaStream_t stream);

}  // namespace kvpress::cuda
