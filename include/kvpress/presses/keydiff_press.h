#pragma once

#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// KeyDiff (arXiv 2504.15364): keeps the keys least similar to the head's mean direction,
// score = -cos(k_i, mean_j k_j/||k_j||). The paper's block-iterative variant is
// BlockPress(KeyDiffPress) in kvpress.
class KeyDiffPress : public ScorerPress {
 public:
  explicit KeyDiffPress(double compression_ratio = 0.0) : ScorerPress(compression_ratio) {}

  std::string name() const override { return "KeyDiffPress"; }

  at::Tensor score(const LayerInputs& inputs) const override { return ops::keydiff_scores(inputs.keys); }
};

}  // namespace kvpress
