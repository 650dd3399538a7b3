// Launcher of the ragged attention kernel (ragged_attention.cuh), as the host bridge sees it, with
// the shape it takes. Torch-free and host-compilable; ragged_attention.cu instantiates it for
// float, __half and __nv_bfloat16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention_plan.h"
#include "cuda/limits.h"

namespace kvpress::cuda {

constexpr int kRaggedWarps = 8;

struct RaggedAttentionShape {
  int64_t batch, q_heads, kv_heads, n, m, dim, packed_tokens;
  int64_t tk_b, tk_h, tk_s;  // tail_keys strides (elements); the last dimension is contiguous
  int64_t tv_b, tv_h, tv_s;  // tail_values strides
  SplitPlan split;           // plan_attention_splits over the units' visible keys
  LaneRows rows;             // plan_lane_rows of the queries', packed and tail rows
  float scale;
};

// `partials`: [units, splits, D + 2] float32 scratch when shape.split.count > 1 (else unused).
// cudaErrorInvalidValue when dim > kAttentionMaxDim, the split count is outside [1, kMaxSplits] or the
// lane layout does not fit dim.
template <typename T>
cudaError_t launch_ragged_attention(const T* queries,                              // [B, Hq, n, D] contiguous
                                    const T* packed_keys, const T* packed_values,  // [packed_tokens, D]
                                    const int64_t* offsets,                        // [B * Hkv + 1]
                                    const T* tail_keys, const T* tail_values,      // [B, Hkv, m, D], strided
                                    T* out,                                        // [B, Hq, n, D]
                                    float* partials, const RaggedAttentionShape& shape, cudaStream_t stream);

}  // namespace kvpress::cuda
