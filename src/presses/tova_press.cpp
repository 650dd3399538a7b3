#include "kvpress/presses/tova_press.h"

#include <ATen/ATen.h>

#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

at::Tensor TOVAPress::score(const LayerInputs& inputs) const {
  // With one query row the mean is that row: [B, Hq, 1, S - 1] as tova_scores expects.
  const at::Tensor attn = ops::window_attention_mean(inputs, 1, "TOVAPress").unsqueeze(2);
  if (!inputs.head_exchange) return ops::tova_scores(attn, inputs.keys.size(1));
  // A rank's share of the heads: the mean over every rank's query heads from their sums (one row of
  // S - 1 floats exchanged), scored as one head's row and repeated for this rank's KV heads.
  const int64_t batch = attn.size(0), heads = attn.size(1) * head_exchange::ranks(inputs);
  const at::Tensor mean = head_exchange::sum_over_ranks(inputs, attn.to(at::kFloat).sum(1, /*keepdim=*/true)) / heads;
  return ops::tova_scores(mean, 1).expand({batch, inputs.keys.size(1), -1}).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"TOVAPress", PressKind::kScorer, "last query's attention, averaged over all heads",
                    window_attention_inputs(), without_params<TOVAPress>};
});

}  // namespace

}  // namespace kvpress
