// Bridge of kvpress::key_norm_scores on CUDA: validation, dtype dispatch, stream, registration.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda/dispatch.h"
#include "scores/cuda/key_norm_launch.h"

namespace kvpress::cuda {
namespace {

at::Tensor key_norm_scores_cuda(const at::Tensor& keys_in) {
  constexpr const char* op = "key_norm_scores";
  checks::check_keys(op, keys_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  at::Tensor out = at::empty({keys.size(0), keys.size(1), keys.size(2)}, keys.options().dtype(at::kFloat));
  const int64_t dim = keys.size(3);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(keys.scalar_type(), op, "keys", [&](auto element) {
    using T = decltype(element);
    check_launch(launch_key_norm_scores<T>(static_cast<const T*>(keys.const_data_ptr()), out.data_ptr<float>(),
                                           keys.numel() / dim, dim, stream),
                 op);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("key_norm_scores", &key_norm_scores_cuda); }

}  // namespace kvpress::cuda
