// Launchers of the paged-cache kernels (paged.cuh), as the host bridge sees them, with the shape
// they take. Torch-free and host-compilable; paged.cu instantiates them for float, __half and
// __nv_bfloat16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention_plan.h"
#include "cuda/limits.h"
#include "paged/kv_codec.h"

namespace kvpress::cuda {

constexpr int kPagedWarps = 4;

struct PagedAttentionShape {
  int64_t batch, q_heads, kv_heads, n, dim;
  int64_t num_pages, page_size, max_pages;
  SplitPlan split;  // plan_attention_splits over the units' keys
  LaneRows rows;    // plan_lane_rows of the queries' and pools' rows
  float scale;
};

// What the paged kernels found wrong in device data they were given without a host check (bits
// or-ed into the `errors` word, src/ops/cuda/device_errors.h). The kernels never read or write outside
// the pools and tables: a unit whose head has a bad length or page gets NaN outputs, a row whose
// slot is out of range is not written.
enum PagedError : int {
  kPagedBadLength = 1 << 0,    // lengths[b, h] outside [n, max_pages * page_size] ((max_pages + 1) * page_size - 1
                               // with residual rows)
  kPagedBadPage = 1 << 1,      // a used page_table entry outside [0, num_pages)
  kPagedBadSlot = 1 << 2,      // a paged_write slot outside [0, num_pages * page_size)
  kPagedBadResidual = 1 << 3,  // a residual_slots entry outside [0, residual rows)
};

// `partials`: [units, splits, D + 2] float32 scratch when shape.split.count > 1 (else unused). `errors`:
// a device word the kernel ors PagedError bits into (nullptr: the caller checked the tables).
// cudaErrorInvalidValue when dim > kAttentionMaxDim, splits is outside [1, 65535] or the lane layout
// does not fit dim.
template <typename T>
cudaError_t launch_paged_attention(const T* queries,           // [B, Hq, n, D] contiguous
                                   const T* key_pool,          // [P, page_size, D]
                                   const T* value_pool,        // [P, page_size, D]
                                   const int64_t* page_table,  // [B, Hkv, max_pages]
                                   const int64_t* lengths,     // [B, Hkv]
                                   T* out,                     // [B, Hq, n, D]
                                   float* partials, int* errors, const PagedAttentionShape& shape, cudaStream_t stream);

// paged_attention over quantized pages: the same kernel and plan, each row dequantized in the lanes
// that read it (no full-precision copy of a page). shape.num_pages / page_size are the pools'.
template <typename T>
cudaError_t launch_paged_attention_quantized(const T* queries,  // [B, Hq, n, D] contiguous
                                             const kernels::QuantizedPagePools<T>& pools,
                                             const int64_t* page_table,  // [B, Hkv, max_pages]
                                             const int64_t* lengths,     // [B, Hkv]
                                             T* out,                     // [B, Hq, n, D]
                                             float* partials, int* errors, const PagedAttentionShape& shape,
                                             cudaStream_t stream);

// Row r of keys/values to slot slots[r] of the pools ([capacity, dim] rows); a slot outside
// [0, capacity) is skipped and reported in `errors` (as above).
template <typename T>
cudaError_t launch_paged_write(T* key_pool, T* value_pool,      // [capacity, dim]
                               const T* keys, const T* values,  // [rows, dim] contiguous
                               const int64_t* slots,            // [rows], distinct
                               int64_t rows, int64_t dim, int64_t capacity, int* errors, cudaStream_t stream);

}  // namespace kvpress::cuda
