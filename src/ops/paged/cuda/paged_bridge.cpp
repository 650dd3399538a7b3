// Bridges of kvpress::paged_attention and kvpress::paged_write on CUDA: validation, the split of
// long heads, dtype dispatch, stream, registration. No host synchronisation unless device argument
// checks are on (kvpress/ops.h): the page tables, lengths and slots stay on the device and the
// kernels check the indices they take from them, recording what is wrong (device_errors.h).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "cuda/device_errors.h"
#include "cuda/dispatch.h"
#include "cuda/shapes.h"
#include "kvpress/ops.h"
#include "paged/cuda/paged_launch.h"
#include "paged/paged.h"

namespace kvpress::cuda {
namespace {

checks::IndexContents index_contents() {
  return ops::device_argument_checks() ? checks::IndexContents::kRead : checks::IndexContents::kLeaveOnDevice;
}

at::Tensor paged_attention_cuda(const at::Tensor& queries_in, const at::Tensor& key_pool_in,
                                const at::Tensor& value_pool_in, const at::Tensor& page_table_in,
                                const at::Tensor& lengths_in, std::optional<double> scale_in) {
  const c10::cuda::CUDAGuard guard(queries_in.device());
  const checks::PagedAttentionArgs a = checks::paged_attention_args(
      queries_in, key_pool_in, value_pool_in, page_table_in, lengths_in, scale_in, index_contents());
  TORCH_CHECK(a.queries.size(3) <= kAttentionMaxDim, "paged_attention: head_dim must be <= ", kAttentionMaxDim,
              " on CUDA, got ", a.queries.size(3));
  at::Tensor out = at::empty(a.queries.sizes(), a.queries.options());
  PagedAttentionShape shape = paged_attention_shape(a.queries, a.key_pool, a.value_pool, a.page_table, a.scale);
  const int64_t units = shape.batch * shape.q_heads * shape.n;
  if (units == 0) return out;
  // The longest head: read where the lengths were copied to the host, else the tables' capacity
  // (splits past a head's length find no keys and weigh nothing).
  int64_t longest = shape.max_pages * shape.page_size;
  if (a.host_lengths.defined()) {
    const int64_t* len = a.host_lengths.const_data_ptr<int64_t>();
    longest = *std::max_element(len, len + a.host_lengths.numel());
  }
  shape.split = plan_attention_splits(units, longest, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  at::Tensor partials;
  if (shape.split.count > 1)
    partials =
        at::empty({units, shape.split.count, split_partial_stride(shape.dim)}, a.queries.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(a.queries.scalar_type(), "paged_attention", "queries", [&](auto element) {
    using T = decltype(element);
    const auto ptr = [](const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); };
    check_launch(launch_paged_attention<T>(
                     ptr(a.queries), ptr(a.key_pool), ptr(a.value_pool), a.page_table.const_data_ptr<int64_t>(),
                     a.lengths.const_data_ptr<int64_t>(), reinterpret_cast<T*>(out.data_ptr()),
                     partials.defined() ? partials.data_ptr<float>() : nullptr, device_error_word(), shape, stream),
                 "paged_attention");
  });
  return out;
}

void paged_write_cuda(at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& keys_in,
                      const at::Tensor& values_in, const at::Tensor& slots_in) {
  const c10::cuda::CUDAGuard guard(key_pool.device());
  checks::check_paged_write(key_pool, value_pool, keys_in, values_in, slots_in, index_contents());
  const at::Tensor keys = keys_in.contiguous(), values = values_in.contiguous(), slots = slots_in.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(key_pool.scalar_type(), "paged_write", "key_pool", [&](auto element) {
    using T = decltype(element);
    check_launch(launch_paged_write<T>(
                     reinterpret_cast<T*>(key_pool.data_ptr()), reinterpret_cast<T*>(value_pool.data_ptr()),
                     reinterpret_cast<const T*>(keys.const_data_ptr()),
                     reinterpret_cast<const T*>(values.const_data_ptr()), slots.const_data_ptr<int64_t>(), keys.size(0),
                     keys.size(1), key_pool.size(0) * key_pool.size(1), device_error_word(), stream),
                 "paged_write");
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) {
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("paged_write", &paged_write_cuda);
}

}  // namespace kvpress::cuda
