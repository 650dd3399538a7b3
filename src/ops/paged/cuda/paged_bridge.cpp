// Bridges of kvpress::paged_attention, paged_attention_quantized and paged_write on CUDA: validation, the split of
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

// The longest head, which the split plan is made for: read where the lengths were copied to the
// host, else `capacity`, the tables' (splits past a head's length find no keys and weigh nothing).
int64_t longest_head(const at::Tensor& host_lengths, int64_t capacity) {
  if (!host_lengths.defined()) return capacity;
  const int64_t* len = host_lengths.const_data_ptr<int64_t>();
  return *std::max_element(len, len + host_lengths.numel());
}

// Plans the splits of `shape` and runs launch(T{}, partials) for the queries' element type T.
template <typename Launch>
at::Tensor run_paged_attention(const char* op, const at::Tensor& queries, PagedAttentionShape shape, int64_t longest,
                               Launch&& launch) {
  TORCH_CHECK(queries.size(3) <= kAttentionMaxDim, op, ": head_dim must be <= ", kAttentionMaxDim, " on CUDA, got ",
              queries.size(3));
  at::Tensor out = at::empty(queries.sizes(), queries.options());
  const int64_t units = shape.batch * shape.q_heads * shape.n;
  if (units == 0) return out;
  shape.split = plan_attention_splits(units, longest, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  at::Tensor partials;
  if (shape.split.count > 1)
    partials =
        at::empty({units, shape.split.count, split_partial_stride(shape.dim)}, queries.options().dtype(at::kFloat));
  dispatch_float_types(queries.scalar_type(), op, "queries", [&](auto element) {
    using T = decltype(element);
    check_launch(launch(element, reinterpret_cast<const T*>(queries.const_data_ptr()),
                        reinterpret_cast<T*>(out.data_ptr()), partials.defined() ? partials.data_ptr<float>() : nullptr,
                        shape, c10::cuda::getCurrentCUDAStream().stream()),
                 op);
  });
  return out;
}

at::Tensor paged_attention_cuda(const at::Tensor& queries_in, const at::Tensor& key_pool_in,
                                const at::Tensor& value_pool_in, const at::Tensor& page_table_in,
                                const at::Tensor& lengths_in, std::optional<double> scale_in) {
  const c10::cuda::CUDAGuard guard(queries_in.device());
  const checks::PagedAttentionArgs a = checks::paged_attention_args(
      queries_in, key_pool_in, value_pool_in, page_table_in, lengths_in, scale_in, index_contents());
  const PagedAttentionShape shape = paged_attention_shape(a.queries, a.key_pool, a.value_pool, a.page_table, a.scale);
  return run_paged_attention(
      "paged_attention", a.queries, shape,
      longest_head(a.host_lengths, kernels::table_capacity(false, shape.max_pages, shape.page_size)),
      [&](auto element, const auto* queries, auto* out, float* partials, const PagedAttentionShape& s,
          cudaStream_t stream) {
        using T = decltype(element);
        return launch_paged_attention<T>(queries, reinterpret_cast<const T*>(a.key_pool.const_data_ptr()),
                                         reinterpret_cast<const T*>(a.value_pool.const_data_ptr()),
                                         a.page_table.const_data_ptr<int64_t>(), a.lengths.const_data_ptr<int64_t>(),
                                         out, partials, device_error_word(), s, stream);
      });
}

at::Tensor paged_attention_quantized_cuda(const at::Tensor& queries, const at::Tensor& key_codes,
                                          const at::Tensor& key_scales, const at::Tensor& value_codes,
                                          const at::Tensor& value_scales, c10::string_view format_name,
                                          const at::Tensor& page_table, const at::Tensor& lengths,
                                          const at::Tensor& residual_keys, const at::Tensor& residual_values,
                                          const at::Tensor& residual_slots, std::optional<double> scale) {
  const c10::cuda::CUDAGuard guard(queries.device());
  const KVFormat format = parse_kv_format(std::string(format_name), "paged_attention_quantized");
  const checks::QuantizedPagedAttentionArgs a = checks::quantized_paged_attention_args(
      queries, key_codes, key_scales, value_codes, value_scales, format, page_table, lengths, residual_keys,
      residual_values, residual_slots, scale, index_contents());
  const PagedAttentionShape shape = quantized_paged_attention_shape(a.queries, a.key_codes, a.residual_keys,
                                                                    a.residual_values, a.page_table, a.scale);
  return run_paged_attention(
      "paged_attention_quantized", a.queries, shape,
      longest_head(a.host_lengths, kernels::table_capacity(true, shape.max_pages, shape.page_size)),
      [&](auto element, const auto* queries, auto* out, float* partials, const PagedAttentionShape& s,
          cudaStream_t stream) {
        using T = decltype(element);
        return launch_paged_attention_quantized<T>(
            queries, a.pools<T>(a.residual_slots), a.page_table.const_data_ptr<int64_t>(),
            a.lengths.const_data_ptr<int64_t>(), out, partials, device_error_word(), s, stream);
      });
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
  m.impl("paged_attention_quantized", &paged_attention_quantized_cuda);
}

}  // namespace kvpress::cuda
