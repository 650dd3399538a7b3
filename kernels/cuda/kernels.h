// CUDA kernels that ops call directly (internal header; plain C++, no CUDA types). Defined in
// kernels/cuda/*.cu when the library is built with CUDA (KVPRESS_WITH_CUDA), otherwise by
// kernels/cuda_unavailable.cpp, where cuda_kernels_built() is false and the others raise. Callers
// check cuda_kernels_built() and fall back to their ATen path when it is false.
// (window_attention_mean and lagkv_partition_scores are dispatcher ops instead: their CUDA
// kernels register under the CUDA key.)
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvpress::kernels {

bool cuda_kernels_built();

// -cos(k_i, anchor), anchor = sequence mean of the L2-normalised keys of the head (eps 1e-12),
// cosine with eps 1e-8 on each norm; float32 accumulation. Same contract as keydiff_scores_cpu.
at::Tensor keydiff_scores_cuda(const at::Tensor& keys);  // [B, H, S, D] CUDA -> [B, H, S] float32

// The k highest scores of every row, ties to the lower position, ascending positions (radix
// select of the k-th value, then one ordered block-wide pass). Returns false, with `out`
// unspecified, when a score is NaN or infinite. Same contract as topk_indices_cpu.
bool topk_indices_cuda(const at::Tensor& scores,  // [B, H, S] floating, CUDA
                       int64_t k,
                       at::Tensor& out);          // [B, H, k] int64, written

// keys/values rows at `indices` into new contiguous tensors. Returns -1, or a non-negative value
// when an index is outside [0, S) (the outputs are then unspecified). Same contract as
// gather_rows_cpu, except that the returned value is not the first bad entry.
int64_t gather_rows_cuda(const at::Tensor& keys,     // [B, H, S, D] CUDA
                         const at::Tensor& values,   // [B, H, S, D] CUDA, same dtype
                         const at::Tensor& indices,  // [B, H, n] int64, CUDA
                         at::Tensor& keys_out,       // [B, H, n, D], written
                         at::Tensor& values_out);    // [B, H, n, D], written

}  // namespace kvpress::kernels
