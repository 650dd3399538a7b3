#include "kvpress/presses/critical_adakv_press.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "kvpress/presses/criticalkv_press.h"
#include "presses/registration.h"

namespace kvpress {

CriticalAdaKVPress::CriticalAdaKVPress(std::shared_ptr<const ScorerPress> press, double alpha_safeguard, double epsilon,
                                       double first_stage_ratio)
    : HeadRaggedWrapperPress(std::move(press), "CriticalAdaKVPress"),
      alpha_safeguard_(alpha_safeguard),
      epsilon_(epsilon),
      first_stage_ratio_(first_stage_ratio) {
  check_params("CriticalAdaKVPress", Params{alpha_safeguard, epsilon, first_stage_ratio});
}

at::Tensor CriticalAdaKVPress::keep_mask(const LayerInputs& in) const {
  constexpr const char* op = "CriticalAdaKVPress.compress_ragged";
  checks::check_kv(op, in.keys, in.values);
  const double ratio = compression_ratio();
  if (ratio == 0.0) return budget::keep_everything(in);
  const int64_t seq = in.keys.size(2);
  const int64_t n_kept = ops::n_kept(seq, ratio);
  constexpr float kMax = std::numeric_limits<float>::max();

  // AdaKV's safeguard, then each head's budget: its share of the layer's Hkv·n_kept best pairs.
  at::Tensor scores =
      budget::force_top_per_head(inner_scores(in, op), budget::safeguard_count(n_kept, alpha_safeguard_));
  const at::Tensor budgets =
      head_exchange::keep_top_across_heads(in, scores, static_cast<double>(n_kept)).sum(-1);  // [B, Hkv] int64

  // Stage 1: each head's top int(budget · first_stage_ratio) are forced (float32 product, as kvpress).
  const at::Tensor first = (budgets.to(at::kFloat) * static_cast<float>(first_stage_ratio_)).to(at::kLong);
  scores = scores.masked_fill(budget::keep_top_per_row(scores, first), kMax);

  // Stage 2: rescale by the projected value norms; the head keeps its `budget` best. Forced entries
  // become max · N (+Inf when N > 1), still above every other score, as in kvpress. kvpress then
  // forces these to max and masks the Hkv·(S - n_kept) lowest of the row, which are exactly the rest.
  const at::Tensor norms = CriticalKVPress::output_projected_value_norms(in, op);
  return budget::keep_top_per_row((scores + epsilon_) * norms, budgets);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"CriticalAdaKVPress",
                    PressKind::kWrapper,
                    "AdaKV head budgets with CriticalKV's two stages per head (head-ragged)",
                    {{}, {"o_proj"}},
                    wrapper_from_params<CriticalAdaKVPress>};
});

}  // namespace

}  // namespace kvpress
