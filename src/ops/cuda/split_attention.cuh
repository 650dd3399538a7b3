// Device code the attention kernels share (paged_attention, ragged_attention; attention_plan.h):
// one query's online softmax over a range of keys by every warp of a block,
// the block's merge of its states into the unit's output or the split's partial state, and the
// kernel that merges the splits of each unit. A state of max NaN marks bad input and makes the
// output NaN.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention_plan.h"
#include "cuda/common.cuh"
#include "cuda/lane_rows.cuh"

namespace kvpress::cuda {

// One query's online softmax (float32) over keys [j_begin, j_end) by every warp of the block: group
// g of warp w (attention_plan.h) takes key j_begin + w * G + g, then every (kWarps * G)-th, G = 32 /
// lanes groups a warp. `q`: the lane's query elements, scaled. `row(j, key, value)` sets key j's rows
// (of type Row: a pointer to the elements, or a handle that a load_lane overload reads) or returns
// false for a row it refuses (skipped). Leaves each group's state in part_max[s],
// part_sum[s] and part_acc[s * dim + d], s = w * G + g, and returns whether this thread saw a row
// refused.
template <int kWarps, typename Row, typename RowFn>
__device__ bool attend_keys(const LaneRows& l, const float* q, int64_t dim, int64_t j_begin, int64_t j_end, RowFn&& row,
                            float* part_max, float* part_sum, float* part_acc) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int groups = kWarpSize / l.lanes, g = lane / l.lanes, lane_in_group = lane % l.lanes;
  float acc[kMaxPerLane], x[kMaxPerLane];
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) acc[t] = 0.f;
  float run_max = -INFINITY, run_sum = 0.f;
  bool refused = false;
  // The warp's lanes run every iteration together (the group sums shuffle over the whole warp).
  for (int64_t base = j_begin + static_cast<int64_t>(warp) * groups; base < j_end;
       base += static_cast<int64_t>(kWarps) * groups) {
    const int64_t j = base + g;
    Row key{}, value{};
    const bool have = j < j_end && row(j, key, value);
    refused |= j < j_end && !have;
    float dot = 0.f;
    if (have) {
      load_lane(key, l, lane_in_group, dim, x);
#pragma unroll
      for (int t = 0; t < kMaxPerLane; ++t) dot += q[t] * x[t];
    }
    for (int offset = l.lanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (!have) continue;
    const float new_max = fmaxf(run_max, dot);
    const float correction = __expf(run_max - new_max);  // 0 for the first key
    const float p = __expf(dot - new_max);
    run_sum = run_sum * correction + p;
    load_lane(value, l, lane_in_group, dim, x);
#pragma unroll
    for (int t = 0; t < kMaxPerLane; ++t) acc[t] = acc[t] * correction + p * x[t];
    run_max = new_max;
  }
  const int state = warp * groups + g;
  if (lane_in_group == 0) {
    part_max[state] = run_max;
    part_sum[state] = run_sum;
  }
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane_element(l, lane_in_group, t);
    if (t < l.per_lane && d < dim) part_acc[state * dim + d] = acc[t];
  }
  return refused;
}

// After a __syncthreads: merges the block's `states` online-softmax states (part_max, part_sum
// [states], part_acc [states * dim]; a state that saw no key has max -inf and weighs 0) and writes
// unit's output row (splits == 1) or its partial state for `split`.
template <typename T>
__device__ void finish_split(const float* part_max, const float* part_sum, const float* part_acc, int states,
                             int64_t dim, int64_t unit, int64_t split, int64_t splits, T* __restrict__ out,
                             float* __restrict__ partials) {
  float total_max = -INFINITY;
  for (int w = 0; w < states; ++w) total_max = fmaxf(total_max, part_max[w]);
  const auto weight = [&](int w) { return part_max[w] == -INFINITY ? 0.f : __expf(part_max[w] - total_max); };
  float total_sum = 0.f;
  for (int w = 0; w < states; ++w) total_sum += part_sum[w] * weight(w);
  if (splits == 1) {  // a new token always sees itself, so total_sum > 0
    T* o = out + unit * dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      float value = 0.f;
      for (int w = 0; w < states; ++w) value += part_acc[w * dim + d] * weight(w);
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
    for (int w = 0; w < states; ++w) value += part_acc[w * dim + d] * weight(w);
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

// Whether `rows` is a lane layout the kernels take for `dim` (plan_lane_rows makes only these).
inline bool valid_lane_rows(const LaneRows& rows, int64_t dim) {
  return rows.lanes >= 1 && rows.lanes <= kWarpSize && (rows.lanes & (rows.lanes - 1)) == 0 && rows.per_lane >= 1 &&
         rows.per_lane <= kMaxPerLane &&
         (rows.vectors ? static_cast<int64_t>(rows.lanes) * rows.per_lane == dim
                       : rows.lanes == kWarpSize && static_cast<int64_t>(kWarpSize) * rows.per_lane >= dim);
}

// Whether an attention launch's plan fits its kernel: head_dim <= kAttentionMaxDim, a split count in
// [1, kMaxSplits] and a lane layout for dim.
inline bool valid_attention_launch(int64_t dim, const SplitPlan& split, const LaneRows& rows) {
  return dim <= kAttentionMaxDim && split.count >= 1 && split.count <= kMaxSplits && valid_lane_rows(rows, dim);
}

}  // namespace kvpress::cuda
