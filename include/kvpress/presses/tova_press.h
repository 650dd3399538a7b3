#pragma once

#include "kvpress/presses/base_press.h"

namespace kvpress {

// TOVA (arXiv 2401.06104): the last token's attention, averaged over all query heads and
// shared by every KV head. The last token is always kept (kvpress's choice; TOVA does not force
// it). Attention from inputs.attentions, inputs.queries or recomputed queries, as SnapKV.
class TOVAPress : public ScorerPress {
 public:
  explicit TOVAPress(double compression_ratio = 0.0) : ScorerPress(compression_ratio) {}

  std::string name() const override { return "TOVAPress"; }
  // The mean over every query head: on a rank's share, their sums are exchanged.
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }

  at::Tensor score(const LayerInputs& inputs) const override;
};

}  // namespace kvpress
