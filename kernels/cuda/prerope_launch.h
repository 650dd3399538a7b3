// Launchers of the pre-RoPE centring kernels of kvpress::sketch_prerope_keys (prerope.cuh), as the
// host bridge sees them. Torch-free and host-compilable; prerope.cu instantiates them for float,
// __half and __nv_bfloat16.
//
// P = the pre-RoPE keys of one KV head, computed as the ATen composite computes them: in float32,
// x * cos - rotate_half(x) * sin, each product and the difference rounded (no fused multiply-add),
// then rounded to the cache dtype T. Unit u (a batch row) of the head starts at keys + u *
// unit_stride and holds seq contiguous rows of dim.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvpress::cuda {

// means[u, d] = P's column mean over the seq rows of unit u, rounded to T (as ATen's mean in T).
template <typename T>
cudaError_t launch_prerope_column_means(const T* keys, int64_t unit_stride,  // unit u: [seq, dim] rows
                                        const float* cos, const float* sin,  // [seq, dim] float32
                                        float* means,                        // [units, dim]
                                        int64_t units, int64_t seq, int64_t dim, cudaStream_t stream);

// out[u, s, d] = P[u, s, d] - means[u, d], rounded to T (the composite's in-place sub_ in T).
template <typename T>
cudaError_t launch_prerope_centred(const T* keys, int64_t unit_stride, const float* cos, const float* sin,
                                   const float* means,  // [units, dim], from launch_prerope_column_means
                                   T* out,              // [units, seq, dim] contiguous
                                   int64_t units, int64_t seq, int64_t dim, cudaStream_t stream);

}  // namespace kvpress::cuda
