#pragma once

#include <memory>
#include <vector>

#include "kvpress/presses/base_press.h"

namespace kvpress {

// ComposedPress (kvpress): applies the presses in order, each to the cache the previous one left.
// The first press gets all inputs; later presses get the shrunk keys/values only (plus num_heads,
// layer indices and inv_freq): hidden states, queries, attentions and cos/sin describe the full
// sequence (kvpress hands them over unchanged, which only key/value presses can use).
// kept_indices are original positions. compression_ratio = 1 - Π(1 - r_i).
class ComposedPress : public BasePress {
 public:
  explicit ComposedPress(std::vector<std::shared_ptr<const BasePress>> presses);

  std::string name() const override { return "ComposedPress"; }
  HeadSpan head_span() const override;  // the widest of its presses'
  KV compress(const LayerInputs& inputs) const override;
  double compression_ratio() const override;
  const std::vector<std::shared_ptr<const BasePress>>& presses() const { return presses_; }

 private:
  std::vector<std::shared_ptr<const BasePress>> presses_;
};

}  // namespace kvpress
