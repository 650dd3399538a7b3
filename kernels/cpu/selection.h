// Fused CPU selection kernels behind ops::topk_indices and ops::gather_kv (internal header).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvpress::kernels {

// The k highest scores of every row, ties to the lower position, returned in ascending position
// order: the same set as a stable descending sort, in O(S) per row (nth_element on a copy, then one
// ordered sweep). Returns false, with `out` unspecified, when a score is NaN or infinite.
bool topk_indices_cpu(const at::Tensor& scores,  // [B, H, S] floating, CPU
                      int64_t k,
                      at::Tensor& out);          // [B, H, k] int64, written

// Copies the rows `indices` of keys and values into new contiguous tensors, one memcpy per row,
// parallel over (batch, head). Returns the index of the first row entry outside [0, S), or -1.
int64_t gather_rows_cpu(const at::Tensor& keys,     // [B, H, S, D] CPU
                        const at::Tensor& values,   // [B, H, S, D] CPU, same dtype
                        const at::Tensor& indices,  // [B, H, n] int64
                        at::Tensor& keys_out,       // [B, H, n, D], written
                        at::Tensor& values_out);    // [B, H, n, D], written

}  // namespace kvpress::kernels
