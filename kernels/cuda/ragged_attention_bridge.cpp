// Bridge of kvpress::ragged_attention on CUDA: validation, dtype dispatch, stream, registration.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/dispatch.h"
#include "cuda/ragged_attention_launch.h"
#include "cuda/shapes.h"
#include "kernel_ops.h"

namespace kvpress::cuda {

namespace {

template <typename T>
void run(const at::Tensor& queries, const at::Tensor& packed_keys, const at::Tensor& packed_values,
         const at::Tensor& offsets, const at::Tensor& tail_keys, const at::Tensor& tail_values, at::Tensor& out,
         double scale, cudaStream_t stream) {
  const RaggedAttentionShape shape = ragged_attention_shape(queries, packed_keys, tail_keys, tail_values, scale);
  const auto ptr = [](const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); };
  const cudaError_t err =
      launch_ragged_attention<T>(ptr(queries), ptr(packed_keys), ptr(packed_values), offsets.const_data_ptr<int64_t>(),
                                 ptr(tail_keys), ptr(tail_values), reinterpret_cast<T*>(out.data_ptr()), shape, stream);
  check_launch(err, "ragged_attention");
}

at::Tensor ragged_attention_cuda(const at::Tensor& queries_in, const at::Tensor& packed_keys_in,
                                 const at::Tensor& packed_values_in, const at::Tensor& offsets_in,
                                 const at::Tensor& tail_keys_in, const at::Tensor& tail_values_in,
                                 std::optional<double> scale_in) {
  const c10::cuda::CUDAGuard guard(queries_in.device());
  const checks::RaggedAttentionArgs a = checks::ragged_attention_args(
      queries_in, packed_keys_in, packed_values_in, offsets_in, tail_keys_in, tail_values_in, scale_in);
  TORCH_CHECK(a.queries.size(3) <= kRaggedMaxDim, "ragged_attention: head_dim must be <= ", kRaggedMaxDim,
              " on CUDA, got ", a.queries.size(3));
  at::Tensor out = at::empty(a.queries.sizes(), a.queries.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(a.queries.scalar_type(), "ragged_attention", "queries", [&](auto element) {
    run<decltype(element)>(a.queries, a.packed_keys, a.packed_values, a.offsets, a.tail_keys, a.tail_values, out,
                           a.scale, stream);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("ragged_attention", &ragged_attention_cuda); }

}  // namespace kvpress::cuda
