// Bridge of kvpress::ragged_attention on CUDA: validation, the split of long heads, dtype dispatch,
// stream, registration.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/dispatch.h"
#include "cuda/shapes.h"
#include "ragged_attention/cuda/ragged_attention_launch.h"
#include "ragged_attention/ragged_attention.h"

namespace kvpress::cuda {

namespace {

at::Tensor ragged_attention_cuda(const at::Tensor& queries_in, const at::Tensor& packed_keys_in,
                                 const at::Tensor& packed_values_in, const at::Tensor& offsets_in,
                                 const at::Tensor& tail_keys_in, const at::Tensor& tail_values_in,
                                 std::optional<double> scale_in) {
  const c10::cuda::CUDAGuard guard(queries_in.device());
  const checks::RaggedAttentionArgs a = checks::ragged_attention_args(
      queries_in, packed_keys_in, packed_values_in, offsets_in, tail_keys_in, tail_values_in, scale_in);
  TORCH_CHECK(a.queries.size(3) <= kAttentionMaxDim, "ragged_attention: head_dim must be <= ", kAttentionMaxDim,
              " on CUDA, got ", a.queries.size(3));
  at::Tensor out = at::empty(a.queries.sizes(), a.queries.options());
  RaggedAttentionShape shape =
      ragged_attention_shape(a.queries, a.packed_keys, a.packed_values, a.tail_keys, a.tail_values, a.scale);
  const int64_t units = shape.batch * shape.q_heads * shape.n;
  if (units == 0) return out;
  // A unit sees at most its head's packed rows and the whole tail.
  shape.split = plan_attention_splits(units, a.longest_packed + shape.m,
                                      at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  at::Tensor partials;
  if (shape.split.count > 1)
    partials =
        at::empty({units, shape.split.count, split_partial_stride(shape.dim)}, a.queries.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(a.queries.scalar_type(), "ragged_attention", "queries", [&](auto element) {
    using T = decltype(element);
    const auto ptr = [](const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); };
    check_launch(launch_ragged_attention<T>(ptr(a.queries), ptr(a.packed_keys), ptr(a.packed_values),
                                            a.offsets.const_data_ptr<int64_t>(), ptr(a.tail_keys), ptr(a.tail_values),
                                            reinterpret_cast<T*>(out.data_ptr()),
                                            partials.defined() ? partials.data_ptr<float>() : nullptr, shape, stream),
                 "ragged_attention");
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("ragged_attention", &ragged_attention_cuda); }

}  // namespace kvpress::cuda
