// Bridge of kvpress::noncausal_column_sums on CUDA: validation, the launch plan (against the device's
// opt-in shared memory), stream, registration. float32 keys take the ATen composite (its logits GEMM
// is on the CUDA cores either way; docs/PERFORMANCE.md "Composites on CUDA"), as do head sizes that
// are not a multiple of 16 and chunks whose keys do not fit in shared memory (plan_noncausal).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "compactor/compactor.h"
#include "compactor/cuda/noncausal_launch.h"
#include "cuda/dispatch.h"

namespace kvpress::cuda {
namespace {

at::Tensor noncausal_column_sums_cuda(const at::Tensor& queries_in, const at::Tensor& keys_in, int64_t chunk_size) {
  constexpr const char* op = "noncausal_column_sums";
  checks::check_noncausal(op, queries_in, keys_in, chunk_size);
  const at::ScalarType dtype = keys_in.scalar_type();
  const int64_t batch = keys_in.size(0), seq = keys_in.size(2), dim = keys_in.size(3);
  const int64_t heads = queries_in.size(1), group = heads / keys_in.size(1);
  if (dtype == at::kFloat) return ops::composite::noncausal_column_sums(queries_in, keys_in, chunk_size);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const size_t shared_limit = at::cuda::getDeviceProperties(keys_in.get_device())->sharedMemPerBlockOptin;
  const NoncausalPlan plan = plan_noncausal(batch, heads, seq, dim, chunk_size, 2, shared_limit);
  if (!plan.applies) return ops::composite::noncausal_column_sums(queries_in, keys_in, chunk_size);
  // The composite's GEMM runs in the keys' dtype; so do the tensor cores here.
  const at::Tensor queries = queries_in.to(dtype), keys = keys_in;
  const at::Tensor q = queries.stride(3) == 1 ? queries : queries.contiguous();
  const at::Tensor k = keys.stride(3) == 1 ? keys : keys.contiguous();
  at::Tensor out = at::empty({batch, heads, seq}, keys.options().dtype(at::kFloat));
  dispatch_float_types(dtype, op, "keys", [&](auto element) {
    using T = decltype(element);
    if constexpr (!std::is_same_v<T, float>) {
      check_launch(launch_noncausal_column_sums<T>(static_cast<const T*>(q.const_data_ptr()), q.stride(0), q.stride(1),
                                                   q.stride(2), static_cast<const T*>(k.const_data_ptr()), k.stride(0),
                                                   k.stride(1), k.stride(2), out.data_ptr<float>(), group, seq, dim,
                                                   chunk_size, plan, c10::cuda::getCurrentCUDAStream()),
                   op);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) { m.impl("noncausal_column_sums", &noncausal_column_sums_cuda); }

}  // namespace kvpress::cuda
