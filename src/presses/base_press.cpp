#include "kvpress/presses/base_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "kvpress/ops.h"

namespace kvpress {

ScorerPress::ScorerPress(double compression_ratio) : compression_ratio_(compression_ratio) {
  checks::check_ratio("ScorerPress", compression_ratio);
}

void ScorerPress::set_compression_ratio(double compression_ratio) {
  checks::check_ratio("ScorerPress", compression_ratio);
  compression_ratio_ = compression_ratio;
}

KV ScorerPress::compress(const LayerInputs& inputs) const {
  const std::string op = name() + ".compress";
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  if (compression_ratio_ == 0.0) {
    // kvpress returns the cache untouched; every position is kept.
    const at::Tensor all = at::arange(seq, inputs.keys.options().dtype(at::kLong)).expand({batch, kv_heads, seq});
    return KV{inputs.keys, inputs.values, all.contiguous()};
  }
  const at::Tensor scores = score(inputs);
  TORCH_CHECK(scores.dim() == 3 && scores.size(0) == batch && scores.size(1) == kv_heads && scores.size(2) == seq,
              op, ": scores must be [", batch, ", ", kv_heads, ", ", seq, "], got ", checks::shape_str(scores));
  checks::check_finite_scores(op.c_str(), scores);
  const at::Tensor kept = ops::topk_indices(scores, ops::n_kept(seq, compression_ratio_));
  return ops::gather_kv(inputs.keys, inputs.values, kept);
}

}  // namespace kvpress
