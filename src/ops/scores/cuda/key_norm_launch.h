// Launcher of the key-norm kernel (key_norm.cuh), as the host bridge sees it. Torch-free and
// host-compilable; key_norm.cu instantiates it for float, __half and __nv_bfloat16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvpress::cuda {

// out[row] = -||keys[row, :]||_2 on `stream`.
template <typename T>
cudaError_t launch_key_norm_scores(const T* keys,  // [rows, dim] contiguous
                                   float* out,     // [rows]
                                   int64_t rows, int64_t dim, cudaStream_t stream);

}  // namespace kvpress::cuda
