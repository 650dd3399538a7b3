// DefensiveKVPress (include/kvpress/presses/defensivekv_press.h, docs/PRESS_NOTES.md).
#include "kvpress/presses/defensivekv_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "checks.h"
#include "kvpress/ops.h"
#include "kvpress/presses/criticalkv_press.h"
#include "presses/head_exchange.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr const char* kOp = "DefensiveKVPress";

// Stage 1: per head, the positions of `attention` [B, Hkv, n] (normalised to sum 1 per head)
// taken by descending weight before the cumulative mass reaches `threshold` (the position reaching
// it excluded; argmax of the first one, 0 when none does), at most `cap` of them; a negative cap
// leaves all but -cap (the authors' slice [:cap]). -> [B, Hkv, n] bool.
at::Tensor first_stage(const at::Tensor& attention, double threshold, int64_t cap) {
  const int64_t n = attention.size(2);
  const at::Tensor normalised = attention / attention.sum(-1, /*keepdim=*/true);
  const auto [sorted, order] = normalised.sort(/*stable=*/true, -1, /*descending=*/true);
  at::Tensor count = (sorted.cumsum(-1) >= threshold).to(at::kInt).argmax(-1);  // [B, Hkv]
  count = count.clamp_max(cap);
  count = at::where(count < 0, (count + n).clamp_min(0), count);
  const at::Tensor rank = at::arange(n, order.options()).view({1, 1, n});
  return at::zeros_like(normalised, at::kBool).scatter_(2, order, rank < count.unsqueeze(-1));
}

}  // namespace

DefensiveKVPress::DefensiveKVPress(double compression_ratio, const Params& params)
    : ScorerPress(compression_ratio), params_(params) {
  check_params(kOp, params_);
}

at::Tensor DefensiveKVPress::score(const LayerInputs& in) const {
  checks::check_kv(kOp, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t w = params_.window_size, n = seq - w;
  TORCH_CHECK(n > 0, kOp, ": the sequence (", seq, " tokens) must be longer than window_size (", w, ")");
  // 1. The window's attention over every key [B, Hq, w, S]. The bias: its mass on the w positions
  // before the window (the authors' code slices the window off, then sums the last w columns left).
  const at::Tensor p = ops::window_probabilities(in, w, kOp);
  const int64_t query_heads = p.size(1), group = query_heads / kv_heads, biased = std::min(w, n);
  const double rows = static_cast<double>(batch * query_heads * head_exchange::ranks(in) * w);
  const at::Tensor bias_mass = p.narrow(3, n - biased, biased).sum().to(at::kDouble).view({1});
  const double window_bias = head_exchange::sum_over_ranks(in, bias_mass).item<double>() / rows;
  const at::Tensor weights = p.narrow(3, 0, n).reshape({batch, kv_heads, group, w, n});
  const at::Tensor mean_attention = weights.mean(2).mean(-2);  // [B, Hkv, n], stage 1's
  // 2. Pooled rows, rescaled to their unpooled mass.
  const at::Tensor pooled = at::avg_pool1d(weights.reshape({-1, w, n}), {params_.kernel_size}, {1},
                                           {params_.kernel_size / 2}, /*ceil_mode=*/false, /*count_include_pad=*/true)
                                .view({batch, kv_heads, group, w, n});
  const at::Tensor rows_mass = weights.sum(-1, /*keepdim=*/true);
  const at::Tensor rescaled = pooled / pooled.sum(-1, /*keepdim=*/true) * rows_mass;
  // 3. Defensive aggregation: the worst case over the group and the rows, floored at its mean.
  const at::Tensor worst = std::get<0>(std::get<0>(rescaled.max(2)).max(-2));  // [B, Hkv, n]
  at::Tensor scores = worst.clamp_min(worst.mean(-1, /*keepdim=*/true));
  // 4. The value norm's share among the layer's KV heads.
  LayerInputs past = in;  // the positions before the window
  past.keys = in.keys.narrow(2, 0, n);
  past.values = in.values.narrow(2, 0, n);
  const at::Tensor norms = CriticalKVPress::output_projected_value_norms(past, kOp);  // [B, Hkv, n]
  scores = scores * (norms / head_exchange::sum_over_ranks(in, norms.sum(1, /*keepdim=*/true)));
  // 5. Stage 1 and 6. the window, raised to the layer's maximum.
  const int64_t cap =
      static_cast<int64_t>(static_cast<double>(n) * (1.0 - compression_ratio()) - static_cast<double>(w));
  const at::Tensor top = head_exchange::max_over_ranks(in, scores.max().view({1}));
  scores = at::where(first_stage(mean_attention, kAttentionMass - window_bias, cap), top, scores);
  return at::cat({scores, top.expand({batch, kv_heads, w})}, 2);
}

at::Tensor DefensiveKVPress::keep_mask(const LayerInputs& in) const {
  checks::check_kv(kOp, in.keys, in.values);
  const int64_t seq = in.keys.size(2);
  if (compression_ratio() == 0.0) return at::ones(in.keys.sizes().slice(0, 3), in.keys.options().dtype(at::kBool));
  // The authors keep int(S·(1 - ratio)·H) pairs of the layer (the product in float64, as here).
  return head_exchange::keep_top_across_heads(in, score(in), static_cast<double>(seq) * (1.0 - compression_ratio()));
}

KV DefensiveKVPress::compress(const LayerInputs&) const { refuse_uniform_compress(); }

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  PressInputs inputs = window_attention_inputs();
  inputs.required = {"o_proj"};
  return PressEntry{"DefensiveKVPress", PressKind::kScorer,
                    "worst case of the window's pooled attention over the group and rows, times the value norm "
                    "share, CriticalKV's stage 1, selected across heads (head-ragged; not in kvpress 0.5.5)",
                    inputs, from_params<DefensiveKVPress>};
});

}  // namespace

}  // namespace kvpress
