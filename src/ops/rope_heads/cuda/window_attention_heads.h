// window_attention_mean's composition on CUDA, shared by its bridge and by the CPU model's test (so
// the test runs the loop the GPU runs): per (batch row, KV head), the float32 logits of its query
// heads' window rows by one GEMM ([group * w, D] x [D, S], queries pre-scaled by 1 / sqrt(D);
// at::mm_out: cuBLAS on CUDA tensors, the CPU's GEMM on the model's), then launch_window_mean.
// Extra memory: one [group * w, S] float32 block, reused for every KV head, and a float32 copy of one
// head's keys when the cache is float16/bfloat16. Host code.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "rope_heads/cuda/window_attention_launch.h"

namespace kvpress::cuda {

// queries [B, Hq, w, D], keys [B, Hkv, S, D] (checked), out [B, Hq, S - w] float32 contiguous.
// Stops at the first launch that fails and returns its error.
inline cudaError_t window_attention_mean_by_heads(const at::Tensor& queries_in, const at::Tensor& keys_in,
                                                  at::Tensor& out, cudaStream_t stream) {
  const int64_t batch = keys_in.size(0), kv_heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  const int64_t heads = queries_in.size(1), window = queries_in.size(2), group = heads / kv_heads;
  const int64_t rows = group * window;
  const at::Tensor queries = (queries_in.to(at::kFloat) * (1.0 / std::sqrt(static_cast<double>(dim)))).contiguous();
  const at::Tensor keys = keys_in.contiguous();
  const auto float_opts = keys.options().dtype(at::kFloat);
  at::Tensor logits = at::empty({rows, seq}, float_opts);
  at::Tensor row_max = at::empty({rows}, float_opts), row_inv_sum = at::empty({rows}, float_opts);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const at::Tensor k = keys.select(0, b).select(0, h).to(at::kFloat);                          // [S, D]
      const at::Tensor q = queries.select(0, b).narrow(0, h * group, group).reshape({rows, dim});  // view
      at::mm_out(logits, q, k.t());
      at::Tensor dst = out.select(0, b).narrow(0, h * group, group);  // [group, S - w], contiguous rows
      const cudaError_t err =
          launch_window_mean(logits.const_data_ptr<float>(), group, seq, window, row_max.data_ptr<float>(),
                             row_inv_sum.data_ptr<float>(), dst.data_ptr<float>(), dst.stride(0), stream);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

}  // namespace kvpress::cuda
