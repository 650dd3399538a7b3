#pragma once

#include <cstdint>

#include "kvpress/presses/snapkv_press.h"

namespace kvpress {

// PyramidKVPress (kvpress; arXiv 2406.02069): SnapKV's scores with a budget that shrinks linearly
// from the first layer to the last, so that the layers together keep about S·(1 - ratio) tokens
// each on average. kvpress's formula (layer_budget below) uses LayerInputs::layer_idx and
// num_layers; every KV head of a layer keeps the same number of tokens. When the pyramid does not
// fit (short inputs), it falls back to max(1, round(S·(1 - ratio))). round() is Python's (half to
// even). Unlike the original PyramidKV the window is part of the budget, not added on top.
class PyramidKVPress : public SnapKVPress {
 public:
  // Raises unless 0 <= ratio < 1, window_size > 0, kernel_size odd and > 0, beta >= 1.
  static constexpr int64_t kDefaultBeta = 20;

  struct Params : SnapKVPress::Params {
    int64_t beta = kDefaultBeta;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      SnapKVPress::Params::for_each_field(self, visit);
      visit(ParamSpec{"beta", "steepness of the pyramid (>= 1)"}, self.beta);
    }
  };

  // Raises as the constructor below.
  PyramidKVPress(double compression_ratio, const Params& params);
  explicit PyramidKVPress(double compression_ratio = 0.0, int64_t window_size = kDefaultWindowSize,
                          int64_t kernel_size = kDefaultKernelSize, int64_t beta = kDefaultBeta);

  std::string name() const override { return "PyramidKVPress"; }
  int64_t beta() const { return beta_; }

  // Tokens kept per KV head in layer `layer_idx` of `num_layers` for a cache of seq_len tokens.
  int64_t layer_budget(int64_t seq_len, int64_t layer_idx, int64_t num_layers) const;

  // SnapKV scores, the top layer_budget(S, inputs.layer_idx, inputs.num_layers) per head.
  KV compress(const LayerInputs& inputs) const override { return gather_kept(inputs); }
  at::Tensor kept_positions(const LayerInputs& inputs) const override;

 private:
  int64_t beta_;
};

}  // namespace kvpress
