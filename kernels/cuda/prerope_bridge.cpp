// Bridge of kvpress::sketch_prerope_keys on CUDA: per KV head, the column means and the centred
// pre-RoPE keys from the post-RoPE keys (prerope.cuh: K read twice, the centred keys written once),
// then the composite's own sketch (cuBLAS, in the cache dtype as kvpress) and Gram matrix. More than
// 65535 batch rows take the composite.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/dispatch.h"
#include "cuda/prerope_launch.h"
#include "kernel_ops.h"

namespace kvpress::cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> sketch_prerope_keys_cuda(const at::Tensor& keys_in, const at::Tensor& cos,
                                                            const at::Tensor& sin, const at::Tensor& sketch) {
  constexpr const char* op = "sketch_prerope_keys";
  checks::check_sketch_prerope_keys(keys_in, cos, sin, sketch);
  const int64_t batch = keys_in.size(0), heads = keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  if (batch > 65535) return ops::composite::sketch_prerope_keys(keys_in, cos, sin, sketch);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor cos_f = cos.to(at::kFloat).contiguous(), sin_f = sin.to(at::kFloat).contiguous();
  at::Tensor x = at::empty({batch, heads, seq, sketch.size(-1)}, keys.options().dtype(at::kFloat));
  at::Tensor means = at::empty({batch, dim}, keys.options().dtype(at::kFloat));
  at::Tensor centred = at::empty({batch, 1, seq, dim}, keys.options());  // one head at a time
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t h = 0; h < heads; ++h) {
    dispatch_float_types(keys.scalar_type(), op, "keys", [&](auto element) {
      using T = decltype(element);
      const T* head = static_cast<const T*>(keys.const_data_ptr()) + h * seq * dim;
      const int64_t unit_stride = heads * seq * dim;  // batch row b of head h
      check_launch(launch_prerope_column_means<T>(head, unit_stride, cos_f.const_data_ptr<float>(),
                                                  sin_f.const_data_ptr<float>(), means.data_ptr<float>(), batch, seq,
                                                  dim, stream),
                   op);
      check_launch(launch_prerope_centred<T>(head, unit_stride, cos_f.const_data_ptr<float>(),
                                             sin_f.const_data_ptr<float>(), means.const_data_ptr<float>(),
                                             static_cast<T*>(centred.data_ptr()), batch, seq, dim, stream),
                   op);
    });
    ops::sketch_centred_into(centred, sketch.dim() == 2 ? sketch : sketch.narrow(1, h, 1), x.narrow(1, h, 1));
  }
  return {x, at::matmul(x.transpose(2, 3), x)};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("sketch_prerope_keys", &sketch_prerope_keys_cuda); }

}  // namespace kvpress::cuda
