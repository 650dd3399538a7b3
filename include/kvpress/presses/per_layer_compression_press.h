#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "kvpress/presses/base_press.h"

namespace kvpress {

// Builds the inner scorer of a wrapper for a given compression ratio.
using ScorerFactory = std::function<std::shared_ptr<const ScorerPress>(double compression_ratio)>;

// PerLayerCompressionPress (kvpress): the inner scorer with compression_ratios[layer_idx] in layer
// layer_idx. kvpress sets the inner press's ratio before each layer's hook and restores it after;
// a C++ press holds only its parameters, so the inner press is built once per ratio from
// `make_press` at construction (its ratio-dependent scores, e.g. StreamingLLM's, follow the layer's
// ratio as in kvpress). Every head of a layer keeps the same number of tokens; layers differ.
// compression_ratio() is the mean of the list. A list of ONE ratio applies to every layer (a
// convenience: kvpress wants one ratio per layer); otherwise compress() raises unless the list has
// exactly LayerInputs::num_layers entries.
class PerLayerCompressionPress : public BasePress {
 public:
  // Raises when make_press is empty, the list is empty, a ratio is outside [0, 1), or make_press
  // returns nullptr.
  PerLayerCompressionPress(ScorerFactory make_press, std::vector<double> compression_ratios);

  std::string name() const override { return "PerLayerCompressionPress"; }
  HeadSpan head_span() const override;  // its inner press's
  double compression_ratio() const override;
  KV compress(const LayerInputs& inputs) const override;

  const std::vector<double>& compression_ratios() const { return compression_ratios_; }
  // The inner press used in layer `layer_idx` of `num_layers`.
  const ScorerPress& press_for_layer(int64_t layer_idx, int64_t num_layers) const;

 private:
  std::vector<double> compression_ratios_;
  std::vector<std::shared_ptr<const ScorerPress>> presses_;  // one per ratio
};

}  // namespace kvpress
