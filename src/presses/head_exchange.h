// What a press needs when its inputs may be one tensor-parallel rank's share of a layer's KV heads
// (LayerInputs::kv_head_range, ::head_exchange): written once for the whole layer and for a share.
// The steps of presses whose scores or budgets span heads (HeadSpan::kExchanged) reach the other
// ranks' heads through the exchange (the identity on a whole layer), and presses reading per-head
// data of the whole layer take the share's rows of it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "kvpress/ops.h"
#include "kvpress/types.h"

namespace kvpress::head_exchange {

// The layer's KV heads on every rank together (the keys' own on a whole layer).
inline int64_t layer_kv_heads(const LayerInputs& in) {
  return in.kv_head_range.layer_kv_heads > 0 ? in.kv_head_range.layer_kv_heads : in.keys.size(1);
}

// The number of ranks the layer's heads are spread over (1 on a whole layer).
inline int64_t ranks(const LayerInputs& in) { return layer_kv_heads(in) / in.keys.size(1); }

// local: [B, n, ...] rows of the heads `in` holds -> the same rows of every head of the layer.
inline at::Tensor all_heads(const LayerInputs& in, const at::Tensor& local) {
  return in.head_exchange ? in.head_exchange->gather_heads(local) : local;
}

// A sum over the heads `in` holds -> the sum over every head of the layer.
inline at::Tensor sum_over_ranks(const LayerInputs& in, const at::Tensor& partial) {
  return in.head_exchange ? in.head_exchange->sum_over_ranks(partial) : partial;
}

// The elementwise maximum over every head of the layer of a maximum over the heads `in` holds.
inline at::Tensor max_over_ranks(const LayerInputs& in, const at::Tensor& partial) {
  return in.head_exchange ? in.head_exchange->max_over_ranks(partial) : partial;
}

// ops::zscore of scores [B, n, ...] over every head of the layer (on a rank's share: the layer's
// mean and unbiased standard deviation, from two all-reduces of float64 sums).
inline at::Tensor zscore(const LayerInputs& in, const at::Tensor& scores) {
  if (!in.head_exchange) return ops::zscore(scores);
  const at::Tensor s = scores.to(at::kFloat);
  const double n = static_cast<double>(s.numel() * ranks(in));
  if (n < 2) return at::zeros_like(s);
  const at::Tensor mean = sum_over_ranks(in, s.sum(at::kDouble).view({1})) / n;
  const at::Tensor centred = s - mean.to(at::kFloat);
  const at::Tensor variance = sum_over_ranks(in, centred.square().sum(at::kDouble).view({1})) / (n - 1);
  return centred / variance.sqrt().to(at::kFloat).clamp_min(ops::kZscoreStdFloor);
}

// layer: per-head data of the whole layer along `dim`, `per_kv_head` rows for each KV head (1 for
// KV-head data, the group size for query-head data) -> the rows of the heads `in` holds. `op` and
// `what` name them in the error when their count is not the layer's.
inline at::Tensor own_rows(const char* op, const char* what, const at::Tensor& layer, int64_t dim,
                           const LayerInputs& in, int64_t per_kv_head = 1) {
  const int64_t heads = in.keys.size(1), rows = layer_kv_heads(in) * per_kv_head;
  TORCH_CHECK(layer.size(dim) == rows, op, ": ", what, " has ", layer.size(dim), " heads, the layer has ", rows,
              in.kv_head_range.layer_kv_heads > 0 ? " (every rank's)" : "");
  TORCH_CHECK(in.kv_head_range.first >= 0 && (in.kv_head_range.first + heads) * per_kv_head <= rows, op,
              ": kv_head_range.first must be in [0, ", rows / per_kv_head - heads, "], got ", in.kv_head_range.first);
  return layer.narrow(dim, in.kv_head_range.first * per_kv_head, heads * per_kv_head);
}

// all_heads()'s result, or what was computed from it: [B, H, ...] rows of every KV head of the layer
// -> the rows of the KV heads `in` holds (without an exchange all_heads() gave those already).
inline at::Tensor own_kv_heads(const LayerInputs& in, const at::Tensor& full) {
  return in.head_exchange ? full.narrow(1, in.kv_head_range.first, in.keys.size(1)) : full;
}

// The layer-wide selection of presses whose budgets vary by head: scores [B, n, S] of the heads `in`
// holds -> the keep mask [B, n, S] of those heads within the int(kept_per_head · H) best (head,
// token) pairs of each batch row over the H heads selected together (every rank's on a share in
// global mode, the held ones otherwise; ops::topk_mask_across_heads).
inline at::Tensor keep_top_across_heads(const LayerInputs& in, const at::Tensor& scores, double kept_per_head) {
  const at::Tensor layer_scores = all_heads(in, scores);
  const auto kept = static_cast<int64_t>(kept_per_head * static_cast<double>(layer_scores.size(1)));
  return own_kv_heads(in, ops::topk_mask_across_heads(layer_scores, kept));
}

}  // namespace kvpress::head_exchange
