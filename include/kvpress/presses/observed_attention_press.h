#pragma once

#include "kvpress/presses/base_press.h"

namespace kvpress {

// H2O-like: mean attention each key received over the queries that can see it. Needs the full
// eager attention matrix (inputs.attentions with Sq == S).
class ObservedAttentionPress : public ScorerPress {
 public:
  explicit ObservedAttentionPress(double compression_ratio = 0.0) : ScorerPress(compression_ratio) {}

  std::string name() const override { return "ObservedAttentionPress"; }

  at::Tensor score(const LayerInputs& inputs) const override;
};

}  // namespace kvpress
