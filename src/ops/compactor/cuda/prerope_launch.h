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

#include <cstddef>
#include <cstdint>

#include "cuda/limits.h"

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

// The fused sketch (half and bfloat16): X[u, s, :] = (P[u, s, :] - means[u, :]) Φ_u in float32 from
// the centred keys rounded to T and Φ in T, each element of X rounded to T, as the composite's GEMM
// in T writes it, never writing the centred keys. A block takes kPreropeSketchRows rows of one unit:
// it un-rotates and centres them into shared memory, then each warp multiplies 16 of them by Φ on
// the tensor cores (wmma).
constexpr int kPreropeSketchWarps = 4;
constexpr int64_t kPreropeSketchRows = 16 * kPreropeSketchWarps;

struct PreropeSketchPlan {
  bool applies = false;  // false: the bridge centres into a buffer and sketches with cuBLAS
  int64_t key_stride = 0, phi_stride = 0, out_stride = 0;   // shared row strides, in elements
  size_t phi_offset = 0, out_offset = 0, shared_bytes = 0;  // bytes
  dim3 grid{1, 1, 1};
};

// Applies when dim and k are multiples of 16, units <= 65535 and the block's shared memory (the
// rows, Φ, the warps' output tiles) fits `shared_limit`, the device's opt-in limit.
inline PreropeSketchPlan plan_prerope_sketch(int64_t units, int64_t seq, int64_t dim, int64_t k, size_t element_bytes,
                                             size_t shared_limit) {
  PreropeSketchPlan plan;
  if (units <= 0 || seq <= 0 || dim % 16 != 0 || k % 16 != 0 || dim == 0 || k == 0 || units > 65535) return plan;
  plan.key_stride = dim + kHalfRowPad;  // shared row paddings: limits.h
  plan.phi_stride = k + kHalfRowPad;
  plan.out_stride = k + kFloatRowPad;
  plan.phi_offset = shared_region_bytes(static_cast<size_t>(kPreropeSketchRows * plan.key_stride) * element_bytes);
  plan.out_offset = plan.phi_offset + shared_region_bytes(static_cast<size_t>(dim * plan.phi_stride) * element_bytes);
  plan.shared_bytes =
      plan.out_offset + shared_region_bytes(static_cast<size_t>(kPreropeSketchRows * plan.out_stride) * sizeof(float));
  if (plan.shared_bytes > shared_limit) return plan;
  const int64_t tiles = (seq + kPreropeSketchRows - 1) / kPreropeSketchRows;
  if (tiles > 2147483647) return plan;
  plan.grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(units));
  plan.applies = true;
  return plan;
}

template <typename T>
cudaError_t launch_prerope_sketch(const T* keys, int64_t unit_stride, const float* cos, const float* sin,
                                  const float* means,  // [units, dim], from launch_prerope_column_means
                                  const T* phi,        // unit u's Φ [dim, k] at phi + u * phi_unit_stride
                                  int64_t phi_unit_stride,
                                  float* out,  // unit u's X [seq, k] at out + u * out_unit_stride
                                  int64_t out_unit_stride, int64_t seq, int64_t dim, int64_t k,
                                  const PreropeSketchPlan& plan, cudaStream_t stream);

}  // namespace kvpress::cuda
