// Selection: n_kept, deterministic top-k, gather of kept K/V.
#include <ATen/ATen.h>

#include <cmath>

#include "checks.h"
#include "cpu/selection.h"
#include "cuda/kernels.h"
#include "kvpress/ops.h"

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
  constexpr const char* op = "topk_indices";
  checks::check_rank(op, "scores", scores, 3, "[batch, heads, seq_len]");
  checks::check_non_empty(op, "scores", scores);
  TORCH_CHECK(at::isFloatingType(scores.scalar_type()), op,
              ": scores must be a floating tensor, got ", scores.scalar_type());
  const int64_t seq_len = scores.size(2);
  TORCH_CHECK(k >= 1 && k <= seq_len, op, ": k must be in [1, seq_len (", seq_len, ")], got ", k);
  if (scores.device().is_cpu() || (scores.is_cuda() && kernels::cuda_kernels_built())) {
    at::Tensor kept;
    const bool finite = scores.is_cuda() ? kernels::topk_indices_cuda(scores, k, kept)
                                         : kernels::topk_indices_cpu(scores, k, kept);
    if (!finite) checks::check_finite_scores(op, scores);  // raises
    return kept;
  }
  checks::check_finite_scores(op, scores);
  // A stable descending sort keeps equal scores in position order, so ties go to the lower
  // position; the k winners are then put back in position order.
  const at::Tensor order = std::get<1>(at::sort(scores, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
  return std::get<0>(at::sort(order.narrow(-1, 0, k), /*dim=*/-1)).contiguous();
}

KV gather_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices) {
  constexpr const char* op = "gather_kv";
  checks::check_kv(op, keys, values);
  checks::check_rank(op, "indices", indices, 3, "[batch, kv_heads, n_kept]");
  TORCH_CHECK(indices.scalar_type() == at::kLong, op, ": indices must be int64, got ",
              indices.scalar_type());
  TORCH_CHECK(indices.size(0) == keys.size(0) && indices.size(1) == keys.size(1), op,
              ": indices must be [", keys.size(0), ", ", keys.size(1), ", n_kept], got ",
              checks::shape_str(indices));
  checks::check_same_device(op, "indices", indices, "keys", keys);
  if (keys.device().is_cpu() || (keys.is_cuda() && kernels::cuda_kernels_built())) {
    at::Tensor keys_out, values_out;
    const int64_t bad = keys.is_cuda() ? kernels::gather_rows_cuda(keys, values, indices, keys_out, values_out)
                                       : kernels::gather_rows_cpu(keys, values, indices, keys_out, values_out);
    if (bad < 0) return KV{keys_out, values_out, indices.contiguous()};
  }
  if (indices.numel() > 0) {  // with a kernel, only reached with an index out of range: name the range
    const int64_t lo = indices.min().item<int64_t>();
    const int64_t hi = indices.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < keys.size(2), op, ": indices must be in [0, seq_len (", keys.size(2),
                ")), got values in [", lo, ", ", hi, "]");
  }
  const at::Tensor expanded = indices.unsqueeze(-1).expand({-1, -1, -1, keys.size(3)});
  return KV{keys.gather(2, expanded).contiguous(), values.gather(2, expanded).contiguous(),
            indices.contiguous()};
}

}  // namespace ops
}  // namespace kvpress
