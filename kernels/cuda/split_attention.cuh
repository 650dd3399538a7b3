// Device code the split attention kernels share (split_plan.h): a block's merge of its warps'
// online-softmax states into the unit's output or the split's partial state, and the kernel that
// merges the splits of each unit. A state of max NaN marks bad input and makes the output NaN.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/split_plan.h"

namespace kvpress::cuda {

// After a __syncthreads: merges the kWarps warps' states (part_max, part_sum [kWarps], part_acc
// [kWarps][kMaxDim]; a warp that saw no key has max -inf and weighs 0) and writes unit's output row
// (splits == 1) or its partial state for `split`.
template <int kWarps, int kMaxDim, typename T>
__device__ void finish_split(const float* part_max, const float* part_sum, const float (*part_acc)[kMaxDim],
                             int64_t dim, int64_t unit, int64_t split, int64_t splits, T* __restrict__ out,
                             float* __restrict__ partials) {
  float total_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total_max = fmaxf(total_max, part_max[w]);
  const auto weight = [&](int w) { return part_max[w] == -INFINITY ? 0.f : __expf(part_max[w] - total_max); };
  float total_sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total_sum += part_sum[w] * weight(w);
  if (splits == 1) {  // a new token always sees itself, so total_sum > 0
    T* o = out + unit * dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      float value = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) value += part_acc[w][d] * weight(w);
      o[d] = from_float<T>(value / total_sum);
    }
    return;
  }
  float* partial = partials + (unit * splits + split) * split_partial_stride(dim);
  if (threadIdx.x == 0) {
    partial[0] = total_max;
    partial[1] = total_sum;
  }
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) value += part_acc[w][d] * weight(w);
    partial[2 + d] = value;
  }
}

// Merges the splits of each unit (one block per unit) into out [units, dim].
template <typename T>
__global__ void attention_split_reduce(const float* __restrict__ partials, T* __restrict__ out, int64_t dim,
                                       int64_t splits) {
  const int64_t unit = blockIdx.x, stride = split_partial_stride(dim);
  const float* p = partials + unit * splits * stride;
  float total_max = -INFINITY;
  bool bad = false;  // a split that met bad input left NaN (fmaxf would drop it)
  for (int64_t c = 0; c < splits; ++c) {
    total_max = fmaxf(total_max, p[c * stride]);
    bad |= isnan(p[c * stride]);
  }
  if (bad) total_max = __uint_as_float(0x7fc00000u);
  float total_sum = 0.f;
  for (int64_t c = 0; c < splits; ++c) {
    const float m = p[c * stride];
    if (m != -INFINITY) total_sum += p[c * stride + 1] * __expf(m - total_max);
  }
  T* o = out + unit * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float value = 0.f;
    for (int64_t c = 0; c < splits; ++c) {
      const float m = p[c * stride];
      if (m != -INFINITY) value += p[c * stride + 2 + d] * __expf(m - total_max);
    }
    o[d] = from_float<T>(value / total_sum);
  }
}

// Launches the reduce after the split kernel when there is more than one split.
template <typename T>
cudaError_t launch_split_reduce(const float* partials, T* out, int64_t units, int64_t dim, int64_t splits,
                                cudaStream_t stream) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || splits == 1) return err;
  KVPRESS_LAUNCH(attention_split_reduce<T>, static_cast<unsigned>(units), 128, 0, stream, partials, out, dim, splits);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
