#include "kvpress/presses/merging_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr double kEps = 1e-6;  // kvpress's: safe for float16 and bfloat16

at::Tensor unit_rows(const at::Tensor& x) {  // [..., D] float32, each row / max(|row|, eps)
  return x / x.norm(2, -1, true).clamp_min(kEps);
}

}  // namespace

MergingPress::MergingPress(std::shared_ptr<const ScorerPress> press, double similarity_threshold, double merge_fraction)
    : ScorerWrapperPress(std::move(press), "MergingPress"),
      similarity_threshold_(similarity_threshold),
      merge_fraction_(merge_fraction) {
  check_params("MergingPress", Params{similarity_threshold, merge_fraction});
  TORCH_CHECK(std::isfinite(merge_fraction) && merge_fraction > 0 && merge_fraction <= 1,
              "MergingPress: merge_fraction must be in (0, 1], got ", merge_fraction);
}

KV MergingPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "MergingPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio() == 0.0) return budget::keep_all(in);
  const int64_t seq = in.keys.size(2);
  const at::Tensor kept = ops::topk_indices(inner_scores(in, op), ops::n_kept(seq, compression_ratio()));
  KV kv = ops::gather_kv(in.keys, in.values, kept);
  const int64_t n_kept = kept.size(2), n_evicted = seq - n_kept;
  if (n_evicted == 0) return kv;

  // The evicted positions, ascending: the complement of the kept ones, [B, Hkv, n_evicted].
  const at::Tensor evicted_mask =
      at::ones(in.keys.sizes().slice(0, 3), kept.options().dtype(at::kBool)).scatter_(2, kept, false);
  const at::Tensor evicted = evicted_mask.nonzero().select(1, 2).view({kept.size(0), kept.size(1), n_evicted});
  // Rows of K or V at evicted positions [r0, r0 + len) of every head, float32: [B, Hkv, len, D].
  const int64_t dim = in.keys.size(3);
  const auto evicted_rows = [&](const at::Tensor& x, int64_t r0, int64_t len) {
    const at::Tensor index = evicted.narrow(2, r0, len).unsqueeze(-1).expand({kept.size(0), kept.size(1), len, dim});
    return x.gather(2, index).to(at::kFloat);
  };
  // Blocks of evicted values of kEvictedBlockElements floats, gathered a block at a time (peak
  // memory: the output and the float32 value sums).
  const int64_t block = std::max<int64_t>(1, kEvictedBlockElements / (kept.size(0) * kept.size(1) * dim));

  // Each evicted token's most similar kept key (cosine, float32): [B, Hkv, n_evicted], one head at
  // a time (its unit evicted and kept keys; max_similarity never holds their similarities).
  at::Tensor max_sim = at::empty(evicted.sizes(), kv.keys.options().dtype(at::kFloat));
  at::Tensor target = at::empty(evicted.sizes(), kept.options());
  for (int64_t b = 0; b < kept.size(0); ++b) {
    for (int64_t h = 0; h < kept.size(1); ++h) {
      const at::Tensor rows = unit_rows(in.keys[b][h].index_select(0, evicted[b][h]).to(at::kFloat));
      const at::Tensor kept_unit = unit_rows(kv.keys[b][h].to(at::kFloat));
      const auto [m, t] = ops::max_similarity(rows.view({1, 1, n_evicted, dim}), kept_unit.view({1, 1, n_kept, dim}));
      max_sim[b][h].copy_(m.view({n_evicted}));
      target[b][h].copy_(t.view({n_evicted}));
    }
  }
  at::Tensor merge = max_sim >= similarity_threshold_;
  if (merge_fraction_ < 1.0 && merge.any().item<bool>()) {
    const at::Tensor eligible = max_sim.masked_fill(~merge, -std::numeric_limits<double>::infinity());
    merge = merge & (max_sim >= at::quantile(eligible, 1.0 - merge_fraction_, /*dim=*/-1, /*keepdim=*/true));
  }
  const at::Tensor kept_values = kv.values.to(at::kFloat);
  const at::Tensor target_norm = kept_values.norm(2, -1).gather(2, target);

  // Σ w·v_e and Σ w per kept token, a block of evicted values at a time.
  at::Tensor value_sum = at::zeros_like(kept_values);
  const at::Tensor weight_sum = at::zeros(kept.sizes(), kept_values.options());
  for (int64_t r0 = 0; r0 < n_evicted; r0 += block) {
    const int64_t len = std::min(block, n_evicted - r0);
    const at::Tensor evicted_values = evicted_rows(in.values, r0, len);
    const at::Tensor evicted_norm = evicted_values.norm(2, -1);
    const at::Tensor weight = max_sim.narrow(2, r0, len).clamp_min(0) * merge.narrow(2, r0, len).to(at::kFloat) *
                              evicted_norm / (evicted_norm + target_norm.narrow(2, r0, len) + kEps);
    const at::Tensor block_target = target.narrow(2, r0, len);
    value_sum.scatter_add_(2, block_target.unsqueeze(-1).expand_as(evicted_values),
                           weight.unsqueeze(-1) * evicted_values);
    weight_sum.scatter_add_(2, block_target, weight);
  }
  // The normalised blend where anything arrived: (kept + Σ w·v) / (1 + Σ w), written in place.
  const at::Tensor blended = value_sum.add_(kept_values).div_((1.0 + weight_sum).unsqueeze(-1));
  at::where_out(kv.values, (weight_sum > 0).unsqueeze(-1), blended.to(kv.values.scalar_type()), kv.values);
  return kv;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"MergingPress",
                    PressKind::kWrapper,
                    "inner scorer's selection; each evicted value folded into its most key-similar kept token",
                    {},
                    wrapper_from_params<MergingPress>};
});

}  // namespace

}  // namespace kvpress
