// Torch-free CUDA kernels of the paged KV cache (see kvpress::ops::paged_attention and
// ops::paged_write).
//
// paged_attention, flash-decoding style: the grid is (units, splits), one unit per (batch row,
// query head, new token). Block (u, s) attends unit u over its s-th chunk of `chunk` visible keys,
// its warps taking the keys round-robin (a key read by a group of lanes, each holding its part of the
// query and the accumulator, as 16-byte vectors where the rows allow: attention_plan.h), with an
// online softmax in float32; the groups' states are merged through shared memory.
// With one split the block writes the output; otherwise it writes its partial state (max, sum,
// unnormalised accumulator) and attention_split_reduce merges the splits of each unit. Splitting
// keeps every SM busy when a decoding batch has few heads but long ones. The same kernel reads
// quantized pages (paged_attention_quantized): each lane dequantizes the elements it holds as it
// loads them (kv_codec.h), so no page is ever copied to full precision.
// paged_write: one thread per element of the copied rows.
// The tables, lengths and slots are device data the host may not have checked (a decode step makes
// no host synchronisation): every index taken from them is checked here before it is used, and what
// is wrong is or-ed into the `errors` word (PagedError) for ops::check_device_errors.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/split_attention.cuh"
#include "paged/cuda/paged_launch.h"
#include "paged/kv_codec.h"

namespace kvpress::cuda {

// Where paged_attention_kernel finds a head's rows. A policy has a Row type (what load_lane reads),
// max_length (the most tokens a table row holds), check_row(b) (PagedError bits for batch row b's
// own device data) and find(s, table, b, h, length, j, key, value): key j's rows, false for a page
// outside the pools.

// Full pages: token j at row j % page_size of page table[j / page_size] of the pools.
template <typename T>
struct FullPages {
  using Row = const T*;
  const T* key_pool;    // [P, page_size, D]
  const T* value_pool;  // [P, page_size, D]

  __device__ int64_t max_length(const PagedAttentionShape& s) const {
    return kernels::table_capacity(false, s.max_pages, s.page_size);
  }
  __device__ int check_row(int64_t) const { return 0; }
  __device__ bool find(const PagedAttentionShape& s, const int64_t* table, int64_t, int64_t, int64_t, int64_t j,
                       Row& key, Row& value) const {
    const int64_t page = table[j / s.page_size];
    if (page < 0 || page >= s.num_pages) return false;
    const int64_t offset = (page * s.page_size + j % s.page_size) * s.dim;
    key = key_pool + offset;
    value = value_pool + offset;
    return true;
  }
};

// kv_codec.h's conversions on the GPU: CUDA's float16 and fp8 e4m3 types (both exact).
struct DeviceNumbers {
  __host__ __device__ static float half(uint16_t bits) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  }
  __host__ __device__ static float fp8(uint8_t bits) {
    __nv_fp8_e4m3 v;
    v.__x = bits;
    return static_cast<float>(v);
  }
};

// A row of a quantized page (row r of `page`), or a residual row in full precision (`full`).
template <typename T, kernels::PageCodec kCodec>
struct QuantizedRow {
  const T* full;  // nullptr for a quantized row
  kernels::PageRef page;
  int64_t r;
  bool keys;
};

// The lane's elements of a quantized row (attention_plan.h's layout), each dequantized where it is
// read; a residual row as load_lane reads any row.
template <typename T, kernels::PageCodec kCodec>
__device__ __forceinline__ void load_lane(const QuantizedRow<T, kCodec>& row, const LaneRows& l, int lane_in_group,
                                          int64_t dim, float* out) {
  if (row.full != nullptr) {
    load_lane(row.full, l, lane_in_group, dim, out);
    return;
  }
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane_element(l, lane_in_group, t);
    out[t] = t < l.per_lane && d < dim ? kernels::page_element<DeviceNumbers, kCodec>(row.keys, row.page, row.r, dim, d)
                                       : 0.f;
  }
}

// Quantized pages: token j of head (b, h) in page table[j / page_size] while j lies in the head's
// full pages, else row j - full of its residual rows.
template <typename T, kernels::PageCodec kCodec>
struct QuantizedPages {
  using Row = QuantizedRow<T, kCodec>;
  kernels::QuantizedPagePools<T> p;

  __device__ int64_t max_length(const PagedAttentionShape& s) const {
    return kernels::table_capacity(true, s.max_pages, s.page_size);
  }
  __device__ int check_row(int64_t b) const {
    return p.residual_slots[b] < 0 || p.residual_slots[b] >= p.residual_rows ? kPagedBadResidual : 0;
  }
  __device__ bool find(const PagedAttentionShape& s, const int64_t* table, int64_t b, int64_t h, int64_t length,
                       int64_t j, Row& key, Row& value) const {
    const int64_t full = p.full_tokens(length);
    if (j >= full) {
      key = Row{p.residual(true, b, h, s.kv_heads, j - full), {}, 0, true};
      value = Row{p.residual(false, b, h, s.kv_heads, j - full), {}, 0, false};
      return true;
    }
    const int64_t page = table[j / s.page_size];
    if (page < 0 || page >= s.num_pages) return false;
    key = Row{nullptr, p.page(true, page), j % s.page_size, true};
    value = Row{nullptr, p.page(false, page), j % s.page_size, false};
    return true;
  }
};

template <typename T, typename Pages>
__global__ void paged_attention_kernel(const T* __restrict__ queries,           // [B, Hq, n, D] contiguous
                                       const Pages pages,                       // FullPages or QuantizedPages
                                       const int64_t* __restrict__ page_table,  // [B, Hkv, max_pages]
                                       const int64_t* __restrict__ lengths,     // [B, Hkv]
                                       T* __restrict__ out,                     // [B, Hq, n, D]
                                       float* __restrict__ partials,  // [units, splits, D + 2] when splits > 1
                                       int* __restrict__ errors, PagedAttentionShape s) {
  __shared__ float part_max[kPagedWarps * kWarpSize], part_sum[kPagedWarps * kWarpSize];
  __shared__ float part_acc[kPagedWarps * kWarpSize * kMaxPerLane];

  const int64_t unit = blockIdx.x, split = blockIdx.y;
  const int64_t i = unit % s.n, bq = unit / s.n, b = bq / s.q_heads, qh = bq % s.q_heads;
  const int64_t h = qh / (s.q_heads / s.kv_heads), bh = b * s.kv_heads + h;
  const int lane = threadIdx.x % kWarpSize;

  float q[kMaxPerLane];
  load_lane(queries + unit * s.dim, s.rows, lane % s.rows.lanes, s.dim, q);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) q[t] *= s.scale;
  const int64_t length = lengths[bh];
  int bad = (length < s.n || length > pages.max_length(s) ? kPagedBadLength : 0) | pages.check_row(b);
  const int64_t n_visible = bad ? 0 : length - s.n + i + 1;  // tokens 0 .. length - n + i
  const int64_t j_begin = split * s.split.chunk;
  const int64_t j_end = j_begin + s.split.chunk < n_visible ? j_begin + s.split.chunk : n_visible;
  const int64_t* table = page_table + bh * s.max_pages;
  const auto row = [&](int64_t j, typename Pages::Row& key, typename Pages::Row& value) {
    return pages.find(s, table, b, h, length, j, key, value);  // false: skipped and reported
  };
  if (attend_keys<kPagedWarps, typename Pages::Row>(s.rows, q, s.dim, j_begin, j_end, row, part_max, part_sum,
                                                    part_acc))
    bad |= kPagedBadPage;
  if (bad && errors != nullptr) atomicOr(errors, bad);
  if (__syncthreads_or(bad)) {  // the unit's output (or this split's part of it) is NaN
    const float nan = __uint_as_float(0x7fc00000u);
    if (s.split.count == 1) {
      for (int64_t d = threadIdx.x; d < s.dim; d += blockDim.x) out[unit * s.dim + d] = from_float<T>(nan);
    } else {
      float* partial = partials + (unit * s.split.count + split) * split_partial_stride(s.dim);
      for (int64_t d = threadIdx.x; d < split_partial_stride(s.dim); d += blockDim.x) partial[d] = nan;
    }
    return;
  }

  finish_split<T>(part_max, part_sum, part_acc, kPagedWarps * (kWarpSize / s.rows.lanes), s.dim, unit, split,
                  s.split.count, out, partials);
}

template <typename T, typename Pages>
cudaError_t launch_paged_attention_over(const T* queries, const Pages& pages, const int64_t* page_table,
                                        const int64_t* lengths, T* out, float* partials, int* errors,
                                        const PagedAttentionShape& shape, cudaStream_t stream) {
  const int64_t units = shape.batch * shape.q_heads * shape.n;
  if (units == 0) return cudaSuccess;
  if (!valid_attention_launch(shape.dim, shape.split, shape.rows)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(shape.split.count));
  KVPRESS_LAUNCH((paged_attention_kernel<T, Pages>), grid, kPagedWarps * 32, 0, stream, queries, pages, page_table,
                 lengths, out, partials, errors, shape);
  return launch_split_reduce<T>(partials, out, units, shape.dim, shape.split.count, stream);
}

template <typename T>
cudaError_t launch_paged_attention(const T* queries, const T* key_pool, const T* value_pool, const int64_t* page_table,
                                   const int64_t* lengths, T* out, float* partials, int* errors,
                                   const PagedAttentionShape& shape, cudaStream_t stream) {
  return launch_paged_attention_over(queries, FullPages<T>{key_pool, value_pool}, page_table, lengths, out, partials,
                                     errors, shape, stream);
}

template <typename T>
cudaError_t launch_paged_attention_quantized(const T* queries, const kernels::QuantizedPagePools<T>& pools,
                                             const int64_t* page_table, const int64_t* lengths, T* out, float* partials,
                                             int* errors, const PagedAttentionShape& shape, cudaStream_t stream) {
  using kernels::PageCodec;
  const auto over = [&](auto pages) {
    return launch_paged_attention_over(queries, pages, page_table, lengths, out, partials, errors, shape, stream);
  };
  switch (pools.codec) {
    case PageCodec::kInt8: return over(QuantizedPages<T, PageCodec::kInt8>{pools});
    case PageCodec::kFp8: return over(QuantizedPages<T, PageCodec::kFp8>{pools});
    case PageCodec::kInt4: return over(QuantizedPages<T, PageCodec::kInt4>{pools});
  }
  return cudaErrorInvalidValue;
}

// Row r of keys/values ([rows, dim]) to slot slots[r] of the pools ([capacity, dim] rows).
template <typename T>
__global__ void paged_write_kernel(T* __restrict__ key_pool, T* __restrict__ value_pool, const T* __restrict__ keys,
                                   const T* __restrict__ values, const int64_t* __restrict__ slots, int64_t rows,
                                   int64_t dim, int64_t capacity, int* __restrict__ errors) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= rows * dim) return;
  const int64_t r = e / dim, d = e % dim, slot = slots[r];
  if (slot < 0 || slot >= capacity) {
    if (d == 0 && errors != nullptr) atomicOr(errors, static_cast<int>(kPagedBadSlot));
    return;
  }
  key_pool[slot * dim + d] = keys[e];
  value_pool[slot * dim + d] = values[e];
}

template <typename T>
cudaError_t launch_paged_write(T* key_pool, T* value_pool, const T* keys, const T* values, const int64_t* slots,
                               int64_t rows, int64_t dim, int64_t capacity, int* errors, cudaStream_t stream) {
  const int64_t elements = rows * dim;
  if (elements == 0) return cudaSuccess;
  constexpr int threads = 256;
  KVPRESS_LAUNCH(paged_write_kernel<T>, static_cast<unsigned>((elements + threads - 1) / threads), threads, 0, stream,
                 key_pool, value_pool, keys, values, slots, rows, dim, capacity, errors);
  return cudaGetLastError();
}

}  // namespace kvpress::cuda
