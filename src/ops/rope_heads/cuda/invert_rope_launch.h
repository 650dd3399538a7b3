// Launcher of the inverse-RoPE kernel (invert_rope.cuh), as the host bridge sees it. Torch-free and
// host-compilable; invert_rope.cu instantiates it for float, __half and __nv_bfloat16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvpress::cuda {

// out = x * cos - rotate_half(x) * sin, row r of x at position r % seq, on `stream`; each product
// and the difference rounded to T as the ATen composite rounds them (bit for bit).
template <typename T>
cudaError_t launch_invert_rope(const T* x,    // [rows, dim] contiguous, rows = B * H * seq
                               const T* cos,  // [seq, dim], in x's dtype
                               const T* sin,  // [seq, dim]
                               T* out,        // [rows, dim]
                               int64_t rows, int64_t seq, int64_t dim, cudaStream_t stream);

}  // namespace kvpress::cuda
