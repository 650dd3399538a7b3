// Bridge of kvpress::invert_rope on CUDA: validation, dtype dispatch, stream, registration.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/dispatch.h"
#include "rope_heads/cuda/invert_rope_launch.h"
#include "rope_heads/rope_heads.h"

namespace kvpress::cuda {
namespace {

at::Tensor invert_rope_cuda(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  constexpr const char* op = "invert_rope";
  checks::check_rope(op, x_in, cos_in, sin_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  // The composite multiplies by cos and sin converted to x's dtype: the kernel reads them so.
  const at::Tensor cos = cos_in.to(x.scalar_type()).contiguous(), sin = sin_in.to(x.scalar_type()).contiguous();
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const int64_t seq = x.size(2), dim = x.size(3);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(x.scalar_type(), op, "x", [&](auto element) {
    using T = decltype(element);
    const auto ptr = [](const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); };
    check_launch(launch_invert_rope<T>(ptr(x), ptr(cos), ptr(sin), static_cast<T*>(out.data_ptr()), x.numel() / dim,
                                       seq, dim, stream),
                 op);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("invert_rope", &invert_rope_cuda); }

}  // namespace kvpress::cuda
