// Private helpers shared by press implementations: the wrappers' inner scores and ratio-0 result,
// and the budgets of the presses that give heads or layers their own (AdaKVPress, CriticalKVPress,
// CriticalAdaKVPress, PyramidKVPress, PerLayerCompressionPress).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "checks.h"
#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"

namespace kvpress::budget {

// `scores` of an inner scorer, checked to be [B, Hkv, S] like in.keys and finite, as float32.
inline at::Tensor checked_inner_scores(const at::Tensor& scores, const LayerInputs& in, const char* op) {
  TORCH_CHECK(scores.dim() == 3 && scores.size(0) == in.keys.size(0) && scores.size(1) == in.keys.size(1) &&
                  scores.size(2) == in.keys.size(2),
              op, ": inner scores must be [", in.keys.size(0), ", ", in.keys.size(1), ", ", in.keys.size(2), "], got ",
              checks::shape_str(scores));
  checks::check_finite_scores(op, scores);
  return scores.to(at::kFloat);
}

// The inner scorer's scores, checked for shape and finiteness, as float32 [B, Hkv, S].
inline at::Tensor inner_scores(const ScorerPress& press, const LayerInputs& in, const char* op) {
  return checked_inner_scores(press.score(in), in, op);
}

// Every position 0..S-1 of every head, the cache untouched (what kvpress returns at ratio 0).
inline KV keep_all(const LayerInputs& in) {
  const int64_t b = in.keys.size(0), h = in.keys.size(1), s = in.keys.size(2);
  const at::Tensor all = at::arange(s, in.keys.options().dtype(at::kLong)).expand({b, h, s});
  return KV{in.keys, in.values, all.contiguous()};
}

// AdaKV's safeguard count: int(n_kept * alpha), at least 1 when alpha > 0 and n_kept > 0.
inline int64_t safeguard_count(int64_t n_kept, double alpha_safeguard) {
  int64_t n_safe = static_cast<int64_t>(static_cast<double>(n_kept) * alpha_safeguard);
  if (alpha_safeguard > 0) n_safe = n_kept > 0 ? std::max<int64_t>(1, n_safe) : 0;
  return n_safe;
}

// [B, H, S] bool: per row (b, h) the counts[b, h] highest scores. Ties go to the lower position
// (stable descending sort). Scores may hold +Inf (CriticalAdaKV's rescaled float-max entries).
inline at::Tensor keep_top_per_row(const at::Tensor& scores,    // [B, H, S] float
                                   const at::Tensor& counts) {  // [B, H] int64, each in [0, S]
  const int64_t seq = scores.size(2);
  const at::Tensor order = std::get<1>(at::sort(scores, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
  const at::Tensor rank_kept = at::arange(seq, counts.options()).view({1, 1, seq}) < counts.unsqueeze(-1);
  return at::zeros_like(rank_kept).scatter_(2, order, rank_kept);
}

// `scores` with the top n_safe positions of every head set to float32's max (kvpress's safeguard
// and first-stage "merge": those positions can then only lose to other forced positions).
inline at::Tensor force_top_per_head(const at::Tensor& scores,  // [B, H, S] float32
                                     int64_t n) {
  if (n <= 0) return scores;
  const at::Tensor counts = at::full({scores.size(0), scores.size(1)}, n, scores.options().dtype(at::kLong));
  return scores.masked_fill(keep_top_per_row(scores, counts), std::numeric_limits<float>::max());
}

// Every position of every head kept (ratio 0: kvpress returns the cache untouched).
inline at::Tensor keep_everything(const LayerInputs& in) {
  return at::ones({in.keys.size(0), in.keys.size(1), in.keys.size(2)}, in.keys.options().dtype(at::kBool));
}

}  // namespace kvpress::budget
