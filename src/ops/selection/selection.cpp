// Selection: n_kept, deterministic top-k and the gather of kept K/V (their CPU/CUDA kernels are in
// cpu/ and cuda/ beside this file; the composites here serve other devices).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "checks.h"
#include "kvpress/ops.h"
#include "selection/selection.h"

namespace kvpress {

void checks::check_finite_scores(const char* op, const at::Tensor& scores) {
  const at::Tensor bad = at::logical_not(at::isfinite(scores));
  if (!bad.any().item<bool>()) return;
  const int64_t count = bad.sum().item<int64_t>();
  const bool has_nan = at::isnan(scores).any().item<bool>();
  TORCH_CHECK(false, op, ": scores must be finite, got ", count, " ", has_nan ? "NaN" : "Inf",
              " value(s) in scores of shape ", shape_str(scores),
              " (a press produced invalid scores; check the inputs for NaN/Inf)");
}

namespace ops {

int64_t n_kept(int64_t seq_len, double compression_ratio) {
  checks::check_non_negative("n_kept", "seq_len", seq_len);
  TORCH_CHECK(std::isfinite(compression_ratio) && compression_ratio >= 0.0,
              "n_kept: compression_ratio must be in [0, 1], got ", compression_ratio);
  if (compression_ratio >= 1.0) return 0;
  // Same expression as kvpress.utils.compute_n_kept: int() truncates the double product.
  const auto kept = static_cast<int64_t>(static_cast<double>(seq_len) * (1.0 - compression_ratio));
  return std::max<int64_t>(1, kept);
}

at::Tensor topk_indices(const at::Tensor& scores, int64_t k) {
  static const auto op = dispatcher_op<at::Tensor(const at::Tensor&, int64_t)>("kvpress::topk_indices");
  checks::check_defined("topk_indices", "scores", scores);  // an undefined tensor dispatches nowhere
  return op.call(scores, k);
}

KV gather_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices) {
  static const auto op =
      dispatcher_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "kvpress::gather_kv");
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"keys", &keys}, {"values", &values}, {"indices", &indices}})
    checks::check_defined("gather_kv", name, *t);  // an undefined tensor dispatches nowhere
  auto [kept_keys, kept_values] = op.call(keys, values, indices);
  return KV{std::move(kept_keys), std::move(kept_values), indices.contiguous()};
}

KV compact_kv_in_place(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices) {
  static const auto op =
      dispatcher_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kvpress::compact_kv_");
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"keys", &keys}, {"values", &values}, {"indices", &indices}})
    checks::check_defined("compact_kv_in_place", name, *t);
  op.call(keys, values, indices);
  const int64_t n = indices.size(2);
  return KV{keys.narrow(2, 0, n), values.narrow(2, 0, n), indices.contiguous()};
}

void composite::compact_kv_(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices) {
  checks::check_compact("compact_kv_in_place", keys, values, indices);
  // Gathered first (a temporary of the kept size), so no row is overwritten before it is read.
  const KV kept = ops::gather_kv(keys, values, indices);  // the dispatcher: the device's gather kernel
  keys.narrow(2, 0, indices.size(2)).copy_(kept.keys);
  values.narrow(2, 0, indices.size(2)).copy_(kept.values);
}

at::Tensor composite::topk_indices(const at::Tensor& scores, int64_t k) {
  constexpr const char* op = "topk_indices";
  checks::check_topk(op, scores, k);
  checks::check_finite_scores(op, scores);
  // A stable descending sort keeps equal scores in position order, so ties go to the lower
  // position; the k winners are then put back in position order.
  const at::Tensor order = std::get<1>(at::sort(scores, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
  return std::get<0>(at::sort(order.narrow(-1, 0, k), /*dim=*/-1)).contiguous();
}

std::tuple<at::Tensor, at::Tensor> composite::gather_kv(const at::Tensor& keys, const at::Tensor& values,
                                                        const at::Tensor& indices) {
  constexpr const char* op = "gather_kv";
  checks::check_gather(op, keys, values, indices);
  checks::check_index_range(op, indices, keys.size(2));
  const at::Tensor expanded = indices.unsqueeze(-1).expand({-1, -1, -1, keys.size(3)});
  return {keys.gather(2, expanded).contiguous(), values.gather(2, expanded).contiguous()};
}

}  // namespace ops
}  // namespace kvpress

// ---- registration: torch.ops.kvpress (src/ops/library.cpp holds the library's root) ----------

namespace kvpress {

TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def("n_kept(int seq_len, float compression_ratio) -> int", &ops::n_kept);
  // Schemas only: the CPU and CUDA kernels (cpu/, cuda/) and the composite below implement them.
  m.def("topk_indices(Tensor scores, int k) -> Tensor");
  m.def("gather_kv(Tensor keys, Tensor values, Tensor indices) -> (Tensor, Tensor)");
  m.def("compact_kv_(Tensor(a!) keys, Tensor(b!) values, Tensor indices) -> ()");
}

// The ATen composites serve every device without a kernel, and CUDA tensors in a build without
// CUDA kernels.
TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("topk_indices", &ops::composite::topk_indices);
  m.impl("gather_kv", &ops::composite::gather_kv);
  m.impl("compact_kv_", &ops::composite::compact_kv_);
}

}  // namespace kvpress
