#include "kvpress/presses/score_blend_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "layer_slices.h"

namespace kvpress {

ScoreBlendPress::ScoreBlendPress(double compression_ratio, std::vector<std::shared_ptr<const ScorerPress>> scorers,
                                 std::vector<double> weights, ScoreBlendOptions options)
    : ScorerPress(compression_ratio), scorers_(std::move(scorers)), weights_(std::move(weights)), options_(options) {
  constexpr const char* op = "ScoreBlendPress";
  TORCH_CHECK(!scorers_.empty(), op, ": scorers must hold at least one press, got none");
  for (const auto& s : scorers_) TORCH_CHECK(s != nullptr, op, ": scorers must not hold a null press");
  TORCH_CHECK(weights_.size() == scorers_.size(), op, ": weights must hold one weight per scorer (", scorers_.size(),
              "), got ", weights_.size());
  for (double w : weights_) TORCH_CHECK(std::isfinite(w), op, ": weights must be finite, got ", w);
  checks::check_non_negative(op, "sink_size_start", options_.sink_size_start);
  checks::check_non_negative(op, "sink_size_end", options_.sink_size_end);
}

HeadSpan ScoreBlendPress::head_span() const {
  HeadSpan span = HeadSpan::kExchanged;  // z-scores, the sinks' maximum and across-heads budgets span heads
  for (const auto& scorer : scorers_) span = wider_span(span, scorer->head_span());
  return span;
}

at::Tensor ScoreBlendPress::score(const LayerInputs& inputs) const {
  const std::string op = name();
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  // kvpress: left = min(start, S), right = min(end, max(0, S - left)).
  const int64_t left = std::min(options_.sink_size_start, seq);
  const int64_t right = std::min(options_.sink_size_end, std::max<int64_t>(0, seq - left));
  const int64_t inner = seq - left - right;
  const auto f32 = inputs.keys.options().dtype(at::kFloat);
  if (inner == 0) return at::ones({batch, kv_heads, seq}, f32);  // every position is a sink

  const LayerInputs sliced = (left == 0 && right == 0) ? inputs : slice_positions(inputs, left, left + inner);
  std::vector<at::Tensor> parts;
  for (const auto& scorer : scorers_) {
    at::Tensor s = scorer->score(sliced);
    TORCH_CHECK(s.dim() == 3 && s.size(0) == batch && s.size(1) == kv_heads && s.size(2) == inner, op, ": ",
                scorer->name(), " returned scores of shape ", checks::shape_str(s), ", expected [", batch, ", ",
                kv_heads, ", ", inner, "]");
    parts.push_back(std::move(s));
  }
  const std::vector<double> w = weights();
  TORCH_CHECK(w.size() == parts.size(), op, ": weights must hold one weight per scorer (", parts.size(), "), got ",
              w.size());
  // On a rank's share each part is z-scored over every rank's heads first.
  const bool normalize_here = options_.normalize && inputs.head_exchange;
  if (normalize_here)
    for (at::Tensor& part : parts) part = head_exchange::zscore(inputs, part);
  const at::Tensor blended = ops::blend_scores(parts, w, options_.normalize && !normalize_here);
  if (left == 0 && right == 0) return blended;
  // Sinks get the layer's maximum (not max + 1), as kvpress pads them.
  const double top = head_exchange::max_over_ranks(inputs, blended.max().view({1})).item<double>();
  return at::cat({at::full({batch, kv_heads, left}, top, f32), blended, at::full({batch, kv_heads, right}, top, f32)},
                 -1);
}

KV ScoreBlendPress::compress(const LayerInputs& inputs) const {
  if (head_ragged()) refuse_uniform_compress();
  return ScorerPress::compress(inputs);
}

at::Tensor ScoreBlendPress::keep_mask(const LayerInputs& inputs) const {
  const std::string op = name() + ".keep_mask";
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  const auto bool_opts = inputs.keys.options().dtype(at::kBool);
  if (compression_ratio() == 0.0) return at::ones({batch, kv_heads, seq}, bool_opts);
  const at::Tensor scores = score(inputs);
  checks::check_finite_scores(op.c_str(), scores);
  const int64_t n_kept = ops::n_kept(seq, compression_ratio());
  if (options_.selection == TokenSelection::kAcrossHeads) {
    return head_exchange::keep_top_across_heads(inputs, scores, static_cast<double>(n_kept));
  }
  at::Tensor mask = at::zeros({batch, kv_heads, seq}, bool_opts);
  mask.scatter_(2, ops::topk_indices(scores, n_kept), true);
  return mask;
}

}  // namespace kvpress
