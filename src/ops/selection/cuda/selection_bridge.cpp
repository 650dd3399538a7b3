// Bridge of kvpress::topk_indices and kvpress::gather_kv on CUDA: validation, stream,
// registration (kernels in selection.cuh).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/dispatch.h"
#include "selection/cuda/selection_launch.h"
#include "selection/selection.h"

namespace kvpress::cuda {
namespace {

at::Tensor topk_indices_cuda(const at::Tensor& scores_in, int64_t k) {
  constexpr const char* op = "topk_indices";
  checks::check_topk(op, scores_in, k);
  // float16/bfloat16 convert to float32 exactly; float64 would lose order: the composite sorts it.
  if (scores_in.scalar_type() == at::kDouble) return ops::composite::topk_indices(scores_in, k);
  const c10::cuda::CUDAGuard guard(scores_in.device());
  const at::Tensor scores = scores_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({scores.size(0), scores.size(1), k}, scores.options().dtype(at::kLong));
  at::Tensor not_finite = at::zeros({1}, scores.options().dtype(at::kInt));
  check_launch(launch_topk_rows(scores.const_data_ptr<float>(), scores.size(0) * scores.size(1), scores.size(2), k,
                                out.data_ptr<int64_t>(), not_finite.data_ptr<int>(), c10::cuda::getCurrentCUDAStream()),
               op);
  if (not_finite.item<int>() != 0) checks::check_finite_scores(op, scores_in);  // raises, naming the values
  return out;
}

std::tuple<at::Tensor, at::Tensor> gather_kv_cuda(const at::Tensor& keys_in, const at::Tensor& values_in,
                                                  const at::Tensor& indices_in) {
  constexpr const char* op = "gather_kv";
  checks::check_gather(op, keys_in, values_in, indices_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous(), values = values_in.contiguous(), indices = indices_in.contiguous();
  const int64_t batch = keys.size(0), heads = keys.size(1), seq = keys.size(2), dim = keys.size(3);
  const int64_t n = indices.size(2);
  at::Tensor keys_out = at::empty({batch, heads, n, dim}, keys.options());
  at::Tensor values_out = at::empty({batch, heads, n, dim}, values.options());
  at::Tensor bad = at::zeros({1}, keys.options().dtype(at::kInt));
  check_launch(
      launch_gather_rows(keys.const_data_ptr(), values.const_data_ptr(), indices.const_data_ptr<int64_t>(),
                         batch * heads, seq, n, dim * static_cast<int64_t>(keys.element_size()), keys_out.data_ptr(),
                         values_out.data_ptr(), bad.data_ptr<int>(), c10::cuda::getCurrentCUDAStream()),
      op);
  if (bad.item<int>() != 0) checks::check_index_range(op, indices, seq);  // raises
  return {keys_out, values_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CUDA, m) {
  m.impl("topk_indices", &topk_indices_cuda);
  m.impl("gather_kv", &gather_kv_cuda);
}

}  // namespace kvpress::cuda
