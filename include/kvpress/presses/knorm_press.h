#pragma once

#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Keeps the keys of smallest L2 norm (arXiv 2406.11430): score = -||k_i||.
class KnormPress : public ScorerPress {
 public:
  explicit KnormPress(double compression_ratio = 0.0) : ScorerPress(compression_ratio) {}

  std::string name() const override { return "KnormPress"; }

  at::Tensor score(const LayerInputs& inputs) const override { return ops::key_norm_scores(inputs.keys); }
};

}  // namespace kvpress
