// Bridge of kvpress::window_attention_mean on CUDA: validation, stream, registration; the per-KV-head
// composition (a cuBLAS GEMM, then the kernels of window_attention.cuh) is window_attention_heads.h.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/dispatch.h"
#include "rope_heads/cuda/window_attention_heads.h"
#include "rope_heads/rope_heads.h"

namespace kvpress::cuda {
namespace {

at::Tensor window_attention_mean_cuda(const at::Tensor& queries_in, const at::Tensor& keys_in) {
  constexpr const char* op = "window_attention_mean";
  checks::check_window_attention(op, queries_in, keys_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  at::Tensor out = at::empty({keys_in.size(0), queries_in.size(1), keys_in.size(2) - queries_in.size(2)},
                             keys_in.options().dtype(at::kFloat));
  check_launch(window_attention_mean_by_heads(queries_in, keys_in, out, c10::cuda::getCurrentCUDAStream()), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("window_attention_mean", &window_attention_mean_cuda); }

}  // namespace kvpress::cuda
