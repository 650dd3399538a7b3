// Torch-free CUDA kernel of kvpress::invert_rope (LeverageScorePress and CompactorPress recover
// pre-RoPE keys with it): one pass writing x * cos - rotate_half(x) * sin, where the ATen composite's
// chain of ops writes five full-size temporaries (about 5x the op's read-once-write-once floor).
// Bit for bit the composite: per element the same two products, each rounded to T, then the
// difference rounded to T; __fmul_rn / __fsub_rn keep nvcc from fusing a product into the
// difference. One thread per element, grid-stride.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "rope_heads/cuda/invert_rope_launch.h"

namespace kvpress::cuda {

constexpr int kInvertRopeThreads = 256;
constexpr int64_t kInvertRopeMaxBlocks = 65535;

template <typename T>
__global__ void invert_rope_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                                   T* __restrict__ out, int64_t elements, int64_t seq, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < elements;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = e % dim, position = (e / dim) % seq;
    // rotate_half(x)[d] = -x[d + half] for the first half, x[d - half] for the second.
    const float rotated = d < half ? -to_float(x[e + half]) : to_float(x[e - half]);
    const int64_t table = position * dim + d;
    const float a = round_to<T>(__fmul_rn(to_float(x[e]), to_float(cos[table])));
    const float b = round_to<T>(__fmul_rn(rotated, to_float(sin[table])));
    out[e] = from_float<T>(__fsub_rn(a, b));
  }
}

template <typename T>
cudaError_t launch_invert_rope(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t seq, int64_t dim,
                               cudaStream_t stream) {
  const int64_t elements = rows * dim;
  if (elements == 0) return cudaSuccess;
  const int64_t blocks =
      std::min<int64_t>((elements + kInvertRopeThreads - 1) / kInvertRopeThreads, kInvertRopeMaxBlocks);
  KVPRESS_LAUNCH(invert_rope_kernel<T>, static_cast<unsigned>(blocks), kInvertRopeThreads, 0, stream, x, cos, sin, out,
                 elements, seq, dim);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
