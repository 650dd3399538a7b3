// Bridge of kvpress::window_attention_mean on CUDA. Per (batch, KV head): the float32 logits of all
// its query heads' window rows come from one cuBLAS GEMM ([group * w, D] x [D, S], queries
// pre-scaled by 1 / sqrt(D)), then the kernels of window_attention.cuh reduce them into the
// output. Extra memory: one [group * w, S] float32 block, reused for every KV head, and a float32
// copy of one head's keys when the cache is float16/bfloat16.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "cuda/dispatch.h"
#include "cuda/window_attention_launch.h"
#include "kernel_ops.h"

namespace kvpress::cuda {
namespace {

at::Tensor window_attention_mean_cuda(const at::Tensor& queries_in, const at::Tensor& keys_in) {
  constexpr const char* op = "window_attention_mean";
  checks::check_window_attention(op, queries_in, keys_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const int64_t batch = keys_in.size(0), kv_heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  const int64_t heads = queries_in.size(1), window = queries_in.size(2), group = heads / kv_heads;
  const int64_t rows = group * window;
  const at::Tensor queries = (queries_in.to(at::kFloat) * (1.0 / std::sqrt(static_cast<double>(dim)))).contiguous();
  const at::Tensor keys = keys_in.contiguous();
  const auto float_opts = keys.options().dtype(at::kFloat);
  at::Tensor out = at::empty({batch, heads, seq - window}, float_opts);
  at::Tensor logits = at::empty({rows, seq}, float_opts);
  at::Tensor row_max = at::empty({rows}, float_opts), row_inv_sum = at::empty({rows}, float_opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const at::Tensor k = keys.select(0, b).select(0, h).to(at::kFloat);                          // [S, D]
      const at::Tensor q = queries.select(0, b).narrow(0, h * group, group).reshape({rows, dim});  // view
      at::mm_out(logits, q, k.t());                                                                // cuBLAS
      at::Tensor dst = out.select(0, b).narrow(0, h * group, group);  // [group, S - w], contiguous rows
      check_launch(launch_window_mean(logits.const_data_ptr<float>(), group, seq, window, row_max.data_ptr<float>(),
                                      row_inv_sum.data_ptr<float>(), dst.data_ptr<float>(), dst.stride(0), stream),
                   op);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("window_attention_mean", &window_attention_mean_cuda); }

}  // namespace kvpress::cuda
