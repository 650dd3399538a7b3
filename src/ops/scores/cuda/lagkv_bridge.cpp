// Bridge of kvpress::lagkv_partition_scores on CUDA: validation, dtype dispatch, stream,
// registration (kernel in lagkv.cuh).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/dispatch.h"
#include "scores/cuda/lagkv_launch.h"
#include "scores/scores.h"

namespace kvpress::cuda {
namespace {

at::Tensor lagkv_partition_scores_cuda(const at::Tensor& keys_in, const at::Tensor& values_in, int64_t n_sink,
                                       int64_t lag_size, bool cross_scoring) {
  constexpr const char* op = "lagkv_partition_scores";
  checks::check_lagkv_partitions(op, keys_in, values_in, n_sink, lag_size);
  const int64_t rows = keys_in.size(0) * keys_in.size(1), seq = keys_in.size(2), dim = keys_in.size(3);
  // Partitions too large for shared memory (lag_size or head_dim in the thousands), or more than
  // 65535 heads, take the ATen composite.
  if (lagkv_shared_bytes(dim, lag_size) + kLagStaticShared > kSharedLimit || rows > 65535)
    return ops::composite::lagkv_partition_scores(keys_in, values_in, n_sink, lag_size, cross_scoring);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous(), values = values_in.contiguous();
  const checks::LagLayout layout = checks::lag_layout(seq, n_sink, lag_size);
  at::Tensor out = at::ones({keys.size(0), keys.size(1), seq}, keys.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(keys.scalar_type(), op, "keys", [&](auto element) {
    using T = decltype(element);
    check_launch(launch_lagkv_partition_scores<T>(
                     static_cast<const T*>(keys.const_data_ptr()), static_cast<const T*>(values.const_data_ptr()), rows,
                     seq, n_sink, lag_size, dim, cross_scoring, layout.n_parts - 1, out.data_ptr<float>(), stream),
                 op);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("lagkv_partition_scores", &lagkv_partition_scores_cuda); }

}  // namespace kvpress::cuda
