// A row read by a group of lanes (attention_plan.h's LaneRows): the lane's part of it, as 16-byte
// vectors where the layout allows, and the sum over the group. Shared by the attention kernels and
// the kernels that take a row per group of lanes (key norm, KeyDiff, LagKV's per-token stds).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention_plan.h"
#include "cuda/common.cuh"

namespace kvpress::cuda {

// Element t of a lane (lane_in_group of its key's group) in the row.
__device__ __forceinline__ int64_t lane_element(const LaneRows& l, int lane_in_group, int t) {
  return l.vectors ? static_cast<int64_t>(lane_in_group) * l.per_lane + t
                   : lane_in_group + static_cast<int64_t>(kWarpSize) * t;
}

// The lane's elements of `row` ([dim] of T) as floats in out[0, kMaxPerLane); 0 where it holds none.
template <typename T>
__device__ __forceinline__ void load_lane(const T* __restrict__ row, const LaneRows& l, int lane_in_group, int64_t dim,
                                          float* out) {
  if (l.vectors) {
    constexpr int kPerVector = kVectorBytes / static_cast<int>(sizeof(T));
    const T* first = row + static_cast<int64_t>(lane_in_group) * l.per_lane;
#pragma unroll
    for (int t0 = 0; t0 < kMaxPerLane; t0 += kPerVector) {
      alignas(kVectorBytes) T part[kPerVector];
      if (t0 < l.per_lane) {
        *reinterpret_cast<uint4*>(part) = *reinterpret_cast<const uint4*>(first + t0);
      }
#pragma unroll
      for (int u = 0; u < kPerVector; ++u) out[t0 + u] = t0 < l.per_lane ? to_float(part[u]) : 0.f;
    }
  } else {
#pragma unroll
    for (int t = 0; t < kMaxPerLane; ++t) {
      const int64_t d = lane_element(l, lane_in_group, t);
      out[t] = d < dim ? to_float(row[d]) : 0.f;
    }
  }
}

// Calls f(d, value) for each element d of `row` the lane holds: the lane's part in layout l, or, for
// the wide layout (l.per_lane == 0: rows longer than kAttentionMaxDim), d = lane_in_group + 32 t.
template <typename T, typename F>
__device__ __forceinline__ void for_lane_elements(const T* __restrict__ row, const LaneRows& l, int lane_in_group,
                                                  int64_t dim, F&& f) {
  if (l.per_lane == 0) {
    for (int64_t d = lane_in_group; d < dim; d += kWarpSize) f(d, to_float(row[d]));
    return;
  }
  float x[kMaxPerLane];
  load_lane(row, l, lane_in_group, dim, x);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane_element(l, lane_in_group, t);
    if (t < l.per_lane && d < dim) f(d, x[t]);
  }
}

// Sum over the lane's group (l.lanes lanes, aligned in the warp); every lane of the warp must call
// it, and every lane of a group gets its group's sum.
__device__ __forceinline__ float group_sum(float v, const LaneRows& l) {
  for (int offset = l.lanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace kvpress::cuda
