#include "kvpress/presses/snapkv_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

SnapKVPress::SnapKVPress(double compression_ratio, const Params& params)
    : ScorerPress(compression_ratio), params_(params) {
  check_params("SnapKVPress", params_);
}

at::Tensor SnapKVPress::score(const LayerInputs& inputs) const {
  const at::Tensor mean_attn = ops::window_attention_mean(inputs, params_.window_size, "SnapKVPress");
  return ops::snapkv_scores_from_mean(mean_attn, inputs.keys.size(1), params_.kernel_size, params_.window_size);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"SnapKVPress", PressKind::kScorer, "attention of the last window_size queries, pooled",
                    window_attention_inputs(), from_params<SnapKVPress>};
});

}  // namespace

}  // namespace kvpress
