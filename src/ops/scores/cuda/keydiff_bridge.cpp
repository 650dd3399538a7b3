// Bridge of kvpress::keydiff_scores on CUDA: validation, dtype dispatch, stream, registration.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/dispatch.h"
#include "scores/cuda/keydiff_launch.h"
#include "scores/scores.h"

namespace kvpress::cuda {
namespace {

at::Tensor keydiff_scores_cuda(const at::Tensor& keys_in) {
  constexpr const char* op = "keydiff_scores";
  checks::check_keys(op, keys_in);
  const int64_t heads = keys_in.size(0) * keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  // Shapes the kernels do not cover (a head_dim in the tens of thousands, > 65535 heads) take the
  // ATen composite.
  if (dim > kKeyDiffMaxDim || heads > 65535) return ops::composite::keydiff_scores(keys_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const auto float_opts = keys.options().dtype(at::kFloat);
  at::Tensor anchor = at::zeros({heads, dim}, float_opts);
  at::Tensor out = at::empty({keys.size(0), keys.size(1), seq}, float_opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(keys.scalar_type(), op, "keys", [&](auto element) {
    using T = decltype(element);
    check_launch(
        launch_keydiff_scores<T>(static_cast<const T*>(keys.const_data_ptr()), heads, seq, static_cast<int>(dim),
                                 anchor.data_ptr<float>(), out.data_ptr<float>(), stream),
        op);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("keydiff_scores", &keydiff_scores_cuda); }

}  // namespace kvpress::cuda
