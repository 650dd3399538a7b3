// A register tile for small dense products on AVX-512 (the leverage sketch, window logits):
// R rows x NV vectors of 16 floats accumulate a[r][t] * b[t][...] over the inner dimension t, one
// broadcast of a per row and NV vector loads of b per step, R x NV FMAs. With R x NV + NV + 1
// within the 32 vector registers and R x NV >= 8 (two FMA pipes, latency 4), the FMA pipes are
// the bound: 230-260 GFLOP/s on the two cores of the development machine, where libtorch's BLAS
// runs narrow shapes ([S x 128] x [128 x 48], [256 x 128] x [128 x S]) at 85-150. Include it only
// from kernel .cpp files and call it from KVPRESS_AVX512_KERNEL functions: it is always inlined,
// and a 16-float vector is one register only there.
#pragma once

#include <cstdint>

#include "cpu/vec16.h"

namespace kvpress::kernels {

// acc[r][v] += sum over t < depth of a[r * row_stride + t * depth_stride] * b[t * b_stride + 16 v + lane].
template <int R, int NV>
KVPRESS_VEC_INLINE void multiply_tile(const float* a, int64_t row_stride, int64_t depth_stride, const float* b,
                                      int64_t b_stride, int64_t depth, vec16::Vec (&acc)[R][NV]) {
  for (int64_t t = 0; t < depth; ++t) {
    vec16::Vec bt[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bt[v] = vec16::load(b + t * b_stride + v * vec16::kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec16::Vec x = vec16::broadcast(a[r * row_stride + t * depth_stride]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bt[v];
    }
  }
}

// The b operand of a logits tile: kt[d][j] = k[j][d] for keys j < width (a multiple of 16), rows
// of k `k_stride` floats apart, dim a multiple of 16; keys from n on are zero. 16 x 16 blocks are
// transposed in registers.
KVPRESS_VEC_INLINE void transpose_keys(const float* k, int64_t k_stride, int64_t n, int64_t width, int64_t dim,
                                       float* kt) {
  for (int64_t j0 = 0; j0 < width; j0 += vec16::kLanes) {
    for (int64_t d0 = 0; d0 < dim; d0 += vec16::kLanes) {
      vec16::Vec block[vec16::kLanes];
      for (int64_t j = 0; j < vec16::kLanes; ++j)
        block[j] = j0 + j < n ? vec16::load(k + (j0 + j) * k_stride + d0) : vec16::Vec{};
      vec16::transpose(block);
      for (int64_t d = 0; d < vec16::kLanes; ++d) vec16::store(kt + (d0 + d) * width + j0, block[d]);
    }
  }
}

}  // namespace kvpress::kernels
