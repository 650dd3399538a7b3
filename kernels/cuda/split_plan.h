// How the attention kernels (paged_attention, ragged_attention) split each unit's keys over blocks,
// flash-decoding style: a unit (one query row) with many keys is attended by several blocks, each
// over its chunk, and a reduce kernel merges their partial states. Torch-free and host-compilable:
// the bridges and the emulated tests plan the same launch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace kvpress::cuda {

constexpr int64_t kMinKeysPerSplit = 128;
constexpr int64_t kMaxSplits = 65535;  // gridDim.y

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

}  // namespace kvpress::cuda
