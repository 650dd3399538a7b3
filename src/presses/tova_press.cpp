#include "kvpress/presses/tova_press.h"

#include <ATen/ATen.h>

#include "kvpress/ops.h"

namespace kvpress {

at::Tensor TOVAPress::score(const LayerInputs& inputs) const {
  // With one query row the mean is that row: [B, Hq, 1, S - 1] as tova_scores expects.
  const at::Tensor attn = ops::window_attention_mean(inputs, 1, "TOVAPress").unsqueeze(2);
  return ops::tova_scores(attn, inputs.keys.size(1));
}

}  // namespace kvpress
