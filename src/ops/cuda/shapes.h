// The kernels' shape structs filled from (checked) tensors, for the CUDA bridges and for the tests
// that run the same launchers through the CPU model (tests/test_cuda_emulation.cpp). Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include "paged/cuda/paged_launch.h"
#include "paged/paged.h"
#include "ragged_attention/cuda/ragged_attention_launch.h"

namespace kvpress::cuda {

// queries [B, Hq, n, D] and packed rows [T, D] contiguous; tail_keys / tail_values [B, Hkv, m, D],
// strided on the first three dimensions.
inline RaggedAttentionShape ragged_attention_shape(const at::Tensor& queries, const at::Tensor& packed_keys,
                                                   const at::Tensor& packed_values, const at::Tensor& tail_keys,
                                                   const at::Tensor& tail_values, double scale) {
  RaggedAttentionShape shape{};
  shape.batch = queries.size(0);
  shape.q_heads = queries.size(1);
  shape.n = queries.size(2);
  shape.dim = queries.size(3);
  shape.kv_heads = tail_keys.size(1);
  shape.m = tail_keys.size(2);
  shape.packed_tokens = packed_keys.size(0);
  shape.tk_b = tail_keys.stride(0);
  shape.tk_h = tail_keys.stride(1);
  shape.tk_s = tail_keys.stride(2);
  shape.tv_b = tail_values.stride(0);
  shape.tv_h = tail_values.stride(1);
  shape.tv_s = tail_values.stride(2);
  // Vector loads need every row the kernel reads on a 16-byte boundary: the bases and the tail's
  // strides (packed and query rows are D apart, which plan_lane_rows checks).
  bool aligned = true;
  for (const at::Tensor* t : {&queries, &packed_keys, &packed_values, &tail_keys, &tail_values})
    aligned = aligned && vector_aligned(t->const_data_ptr());
  for (const int64_t stride : {shape.tk_b, shape.tk_h, shape.tk_s, shape.tv_b, shape.tv_h, shape.tv_s})
    aligned = aligned && (stride * queries.element_size()) % kVectorBytes == 0;
  shape.rows = plan_lane_rows(shape.dim, queries.element_size(), aligned);
  shape.scale = static_cast<float>(scale);
  return shape;
}

// queries [B, Hq, n, D] contiguous, page_table [B, Hkv, max_pages], pools of num_pages pages of
// page_size rows; `aligned`: every full-precision row the kernel reads starts on a 16-byte
// boundary. The split plan (shape.split) is left to plan_attention_splits.
inline PagedAttentionShape paged_shape(const at::Tensor& queries, const at::Tensor& page_table, int64_t num_pages,
                                       int64_t page_size, bool aligned, double scale) {
  PagedAttentionShape shape{};
  shape.batch = queries.size(0);
  shape.q_heads = queries.size(1);
  shape.n = queries.size(2);
  shape.dim = queries.size(3);
  shape.kv_heads = page_table.size(1);
  shape.max_pages = page_table.size(2);
  shape.num_pages = num_pages;
  shape.page_size = page_size;
  shape.rows = plan_lane_rows(shape.dim, queries.element_size(), aligned);
  shape.scale = static_cast<float>(scale);
  return shape;
}

// paged_attention: pools [P, page_size, D] contiguous.
inline PagedAttentionShape paged_attention_shape(const at::Tensor& queries, const at::Tensor& key_pool,
                                                 const at::Tensor& value_pool, const at::Tensor& page_table,
                                                 double scale) {
  const bool aligned = vector_aligned(queries.const_data_ptr()) && vector_aligned(key_pool.const_data_ptr()) &&
                       vector_aligned(value_pool.const_data_ptr());
  return paged_shape(queries, page_table, key_pool.size(0), key_pool.size(1), aligned, scale);
}

// paged_attention_quantized: codes [P, page_size, code_bytes], residual rows [R, Hkv, page_size, D]
// contiguous (the rows read in full precision; the lanes read codes one element at a time).
inline PagedAttentionShape quantized_paged_attention_shape(const at::Tensor& queries, const at::Tensor& key_codes,
                                                           const at::Tensor& residual_keys,
                                                           const at::Tensor& residual_values,
                                                           const at::Tensor& page_table, double scale) {
  const bool aligned = vector_aligned(queries.const_data_ptr()) && vector_aligned(residual_keys.const_data_ptr()) &&
                       vector_aligned(residual_values.const_data_ptr());
  return paged_shape(queries, page_table, key_codes.size(0), key_codes.size(1), aligned, scale);
}

}  // namespace kvpress::cuda
