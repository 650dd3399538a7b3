#include "kvpress/presses/tova_press.h"

#include <ATen/ATen.h>

#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

at::Tensor TOVAPress::score(const LayerInputs& inputs) const {
  // With one query row the mean is that row: [B, Hq, 1, S - 1] as tova_scores expects.
  const at::Tensor attn = ops::window_attention_mean(inputs, 1, "TOVAPress").unsqueeze(2);
  return ops::tova_scores(attn, inputs.keys.size(1));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"TOVAPress", PressKind::kScorer, "last query's attention, averaged over all heads",
                    window_attention_inputs(), without_params<TOVAPress>};
});

}  // namespace

}  // namespace kvpress
