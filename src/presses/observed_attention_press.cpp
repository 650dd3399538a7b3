#include "kvpress/presses/observed_attention_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

at::Tensor ObservedAttentionPress::score(const LayerInputs& inputs) const {
  constexpr const char* op = "ObservedAttentionPress";
  checks::check_kv(op, inputs.keys, inputs.values);
  TORCH_CHECK(inputs.attentions.defined(), op, ": needs attentions (the full eager attention matrix); none were given");
  checks::check_same_device(op, "attentions", inputs.attentions, "keys", inputs.keys);
  const at::Tensor& a = inputs.attentions;
  TORCH_CHECK(a.dim() == 4 && a.size(0) == inputs.keys.size(0) && a.size(3) == inputs.keys.size(2), op,
              ": attentions must be [", inputs.keys.size(0), ", num_heads, ", inputs.keys.size(2), ", ",
              inputs.keys.size(2), "], got ", checks::shape_str(a));
  return ops::observed_attention_scores(a, inputs.keys.size(1));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"ObservedAttentionPress",
                    PressKind::kScorer,
                    "mean attention received (H2O-like)",
                    {{{{"attentions"}, true}}},
                    without_params<ObservedAttentionPress>};
});

}  // namespace

}  // namespace kvpress
