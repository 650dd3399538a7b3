#include "kvpress/presses/adakv_press.h"

#include <ATen/ATen.h>

#include <cmath>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

AdaKVPress::AdaKVPress(std::shared_ptr<const ScorerPress> press, double alpha_safeguard)
    : HeadRaggedWrapperPress(std::move(press), "AdaKVPress"), alpha_safeguard_(alpha_safeguard) {
  check_params("AdaKVPress", Params{alpha_safeguard});
}

at::Tensor AdaKVPress::keep_mask(const LayerInputs& in) const {
  constexpr const char* op = "AdaKVPress.compress_ragged";
  checks::check_kv(op, in.keys, in.values);
  const double ratio = compression_ratio();
  if (ratio == 0.0) return budget::keep_everything(in);
  const int64_t seq = in.keys.size(2);
  const int64_t n_kept = ops::n_kept(seq, ratio);
  const at::Tensor scores =
      budget::force_top_per_head(inner_scores(in, op), budget::safeguard_count(n_kept, alpha_safeguard_));
  // kvpress masks the Hkv·(S - n_kept) lowest scores of each batch row; we keep the rest.
  return head_exchange::keep_top_across_heads(in, scores, static_cast<double>(n_kept));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"AdaKVPress",
                    PressKind::kWrapper,
                    "inner scores, safeguarded, kept across heads (head budgets vary; head-ragged)",
                    {},
                    wrapper_from_params<AdaKVPress>};
});

}  // namespace

}  // namespace kvpress
