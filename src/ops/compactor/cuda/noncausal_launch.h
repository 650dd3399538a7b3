// The launch plan and launcher of kvpress::noncausal_column_sums' CUDA kernel (noncausal.cuh), as the
// host bridge sees them. Torch-free and host-compilable; noncausal.cu instantiates the launcher for
// __half and __nv_bfloat16 (float32 takes the composite: its logits GEMM runs on the CUDA cores either
// way, docs/PERFORMANCE.md "Composites on CUDA").
//
// One block per (chunk, query head, batch row): the chunk's keys are staged in shared memory once,
// then each warp takes 16 query rows at a time, makes their logits against every key of the chunk
// with the tensor cores (wmma, float32 accumulation), rounds them to the input dtype as kvpress's
// GEMM in that dtype does, takes each row's softmax and adds it into the warp's column sums. The
// logits never leave shared memory.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/limits.h"

namespace kvpress::cuda {

constexpr int kNoncausalTile = 16;     // wmma's m = n = k
constexpr int kNoncausalMaxWarps = 4;  // warps of a block, at most

struct NoncausalPlan {
  bool applies = false;      // false: the kernel does not cover this shape (the bridge takes the composite)
  int warps = 0;             // warps of a block
  int64_t width = 0;         // the longest chunk's keys, rounded up to whole tiles
  int64_t key_stride = 0;    // elements between shared rows of keys and of query tiles
  int64_t logit_stride = 0;  // floats between shared rows of logits
  size_t logits_offset = 0, sums_offset = 0, keys_offset = 0, queries_offset = 0;  // bytes
  size_t shared_bytes = 0;                                                         // dynamic shared memory of a block
  dim3 grid{1, 1, 1};
};

// The shared memory of a block with `warps` warps, laid out in `plan` (width and strides set).
inline void noncausal_layout(NoncausalPlan& plan, int warps, size_t element_bytes) {
  const size_t tile = kNoncausalTile, width = static_cast<size_t>(plan.width);
  plan.warps = warps;
  plan.logits_offset = 0;  // [warps][16][logit_stride] float
  plan.sums_offset = shared_region_bytes(warps * tile * static_cast<size_t>(plan.logit_stride) * sizeof(float));
  plan.keys_offset = plan.sums_offset + shared_region_bytes(warps * width * sizeof(float));  // [warps][width] float
  plan.queries_offset =  // keys: [width][key_stride] T
      plan.keys_offset + shared_region_bytes(width * static_cast<size_t>(plan.key_stride) * element_bytes);
  plan.shared_bytes =  // query tiles: [warps][16][key_stride] T
      plan.queries_offset + shared_region_bytes(warps * tile * static_cast<size_t>(plan.key_stride) * element_bytes);
}

// queries [batch, heads, seq, dim], keys [batch, heads / group, seq, dim] of `element_bytes` (2);
// `shared_limit` the device's opt-in shared memory per block. Applies when dim is a multiple of 16,
// the grid fits (chunks < 2^31, heads and batch <= 65535) and one warp's layout fits the limit;
// takes the most warps (up to kNoncausalMaxWarps, no more than the chunk's row tiles) that fit.
inline NoncausalPlan plan_noncausal(int64_t batch, int64_t heads, int64_t seq, int64_t dim, int64_t chunk,
                                    size_t element_bytes, size_t shared_limit) {
  NoncausalPlan plan;
  if (batch <= 0 || heads <= 0 || seq <= 0 || dim <= 0 || chunk <= 0) return plan;
  const int64_t chunks = (seq + chunk - 1) / chunk;
  if (dim % kNoncausalTile != 0 || chunks > 2147483647 || heads > 65535 || batch > 65535) return plan;
  plan.width = (std::min(chunk, seq) + kNoncausalTile - 1) / kNoncausalTile * kNoncausalTile;
  plan.key_stride = dim + kHalfRowPad;
  plan.logit_stride = plan.width + kFloatRowPad;
  const int tiles = static_cast<int>(std::min<int64_t>(plan.width / kNoncausalTile, kNoncausalMaxWarps));
  for (int warps = tiles; warps >= 1; --warps) {
    noncausal_layout(plan, warps, element_bytes);
    if (plan.shared_bytes <= shared_limit) {
      plan.applies = true;
      plan.grid = dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
      return plan;
    }
  }
  return plan;
}

// out[b, h, s] = the column sums of kvpress's non-causal chunked attention (kvpress::
// noncausal_column_sums). Rows of queries and keys have unit stride along dim; `plan` from
// plan_noncausal on the same shape (applies).
template <typename T>
cudaError_t launch_noncausal_column_sums(const T* queries, int64_t q_batch_stride, int64_t q_head_stride,
                                         int64_t q_row_stride,  // [batch, heads, seq, dim]
                                         const T* keys, int64_t k_batch_stride, int64_t k_head_stride,
                                         int64_t k_row_stride,  // [batch, heads / group, seq, dim]
                                         float* out,            // [batch, heads, seq] contiguous
                                         int64_t group, int64_t seq, int64_t dim, int64_t chunk,
                                         const NoncausalPlan& plan, cudaStream_t stream);

}  // namespace kvpress::cuda
