// How the attention kernels (paged_attention, ragged_attention) lay out a launch, decided on the host
// so that the bridges and the emulated tests launch alike. Torch-free and host-compilable.
//
// Splits, flash-decoding style: a unit (one query row) with many keys is attended by several
// blocks, each over its chunk, and a reduce kernel merges their partial states.
//
// Lanes: a key row of D elements is read by a group of `lanes` lanes of a warp, each holding
// `per_lane` of its elements; a warp takes 32 / lanes keys at once. Where rows are 16-byte aligned
// and D fills whole 16-byte vectors a power-of-two number of times, each lane holds contiguous
// elements read as 16-byte vectors (bfloat16 D = 128: 16 lanes of 8 elements, two keys a warp);
// elsewhere 32 lanes hold elements d = lane + 32 t (scalar loads).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/limits.h"

namespace kvpress::cuda {

constexpr int64_t kMinKeysPerSplit = 128;
constexpr int64_t kMaxSplits = 65535;                          // gridDim.y
constexpr int kMaxPerLane = 8;                                 // elements a lane holds: head_dim <= 32 * 8 = 256
constexpr int64_t kAttentionMaxDim = kWarpSize * kMaxPerLane;  // 256
constexpr int kVectorBytes = 16;

struct SplitPlan {
  int64_t count = 1;  // splits per unit
  int64_t chunk = 0;  // keys [s * chunk, (s + 1) * chunk) of a unit go to split s
};

// About 4 blocks per SM over the grid, each split holding at least kMinKeysPerSplit keys. `units` >
// 0 query rows, `longest` the most keys a unit may see, `sms` the device's multiprocessor count.
inline SplitPlan plan_attention_splits(int64_t units, int64_t longest, int64_t sms) {
  const int64_t wanted = std::max<int64_t>(1, (4 * sms + units - 1) / units);
  SplitPlan plan;
  plan.count = std::clamp<int64_t>((longest + kMinKeysPerSplit - 1) / kMinKeysPerSplit, 1, wanted);
  plan.count = std::min(plan.count, kMaxSplits);
  plan.chunk = (longest + plan.count - 1) / plan.count;
  return plan;
}

// Partial state of one (unit, split) in the float32 scratch [units, splits, stride]: max, sum, then
// the dim accumulator values.
__host__ __device__ inline int64_t split_partial_stride(int64_t dim) { return dim + 2; }

struct LaneRows {
  int lanes = kWarpSize;  // lanes per key: a power of two dividing 32
  int per_lane = 0;       // elements per lane (lanes * per_lane >= D)
  bool vectors = false;   // contiguous elements read as 16-byte vectors, else d = lane + 32 t
};

// `dim` <= 32 * kMaxPerLane elements of `element_bytes`; `aligned`: every row the kernel reads starts
// on a 16-byte boundary.
inline LaneRows plan_lane_rows(int64_t dim, int64_t element_bytes, bool aligned) {
  LaneRows rows;
  rows.per_lane = static_cast<int>((dim + kWarpSize - 1) / kWarpSize);
  const int64_t row_bytes = dim * element_bytes;
  if (!aligned || row_bytes % kVectorBytes != 0) return rows;
  const int64_t vectors = row_bytes / kVectorBytes, per_vector = kVectorBytes / element_bytes;
  if (vectors <= kWarpSize && (vectors & (vectors - 1)) == 0 && per_vector <= kMaxPerLane) {
    rows = {static_cast<int>(vectors), static_cast<int>(per_vector), true};  // one vector a lane
  } else if (vectors % kWarpSize == 0 && dim / kWarpSize <= kMaxPerLane) {
    rows = {kWarpSize, static_cast<int>(dim / kWarpSize), true};  // several vectors a lane
  }
  return rows;
}

// The layout of rows that a group of lanes reads whole (key norm, KeyDiff, LagKV): plan_lane_rows up
// to kAttentionMaxDim elements; longer rows take the wide layout (32 lanes, d = lane + 32 t, scalar
// loads, per_lane 0: lane_rows.cuh's for_lane_elements).
inline LaneRows plan_row_lanes(int64_t dim, int64_t element_bytes, bool aligned) {
  return dim <= kAttentionMaxDim ? plan_lane_rows(dim, element_bytes, aligned) : LaneRows{kWarpSize, 0, false};
}

// Whether p lies on a 16-byte boundary (the start of a vector load).
inline bool vector_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }

}  // namespace kvpress::cuda
