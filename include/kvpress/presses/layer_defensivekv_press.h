#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "kvpress/presses/defensivekv_press.h"

namespace kvpress {

// Layer-DefensiveKV (arXiv 2510.13334; the authors' EfficientLayerDefensiveKVPress in
// github.com/FFY0/DefensiveKV; not in kvpress 0.5.5): DefensiveKVPress's scores in every layer, each
// layer's own (its stage 1 and window raised to that layer's maximum), then one selection across
// layers, heads and positions: the int(N (1 - ratio) Hkv L) best (layer, head, position) triples of
// the context (ties: the lower layer, then head, then position), so layers and heads keep different
// numbers of tokens. Batch 1, as the authors' code asserts.
//
// One layer is not enough (compress() and keep_mask() raise): its second pass runs the context
// through the model layer by layer (one layer's keys/values at a time), scores each layer, selects,
// then prefills again keeping the selection (kvpress::llama's prefill()/generate_greedy() run it).
// The authors' code instead holds every layer's full cache until the last layer's hook.
class LayerDefensiveKVPress : public BasePress {
 public:
  using Params = DefensiveKVPress::Params;

  // Raises c10::Error for a ratio outside [0, 1) or a parameter outside its declared range.
  LayerDefensiveKVPress(double compression_ratio, const Params& params);
  explicit LayerDefensiveKVPress(double compression_ratio = 0.0,
                                 int64_t window_size = DefensiveKVPress::kDefaultWindowSize,
                                 int64_t kernel_size = DefensiveKVPress::kDefaultKernelSize)
      : LayerDefensiveKVPress(compression_ratio, Params{window_size, kernel_size}) {}

  std::string name() const override { return "LayerDefensiveKVPress"; }
  double compression_ratio() const override { return layer_press_.compression_ratio(); }
  const Params& params() const { return layer_press_.params(); }
  bool head_ragged() const override { return true; }
  bool needs_second_pass() const override { return true; }
  // Its scores and its selection span heads: on tensor-parallel shards they are exchanged.
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }
  bool second_pass_shardable() const override { return true; }

  // Every layer's keep mask from every layer's scores [L, Hkv, N] (DefensiveKVPress::score per
  // layer) -> L x [1, Hkv, N] bool.
  std::vector<at::Tensor> keep_masks(const at::Tensor& scores) const;
  void second_pass(SecondPassRun& run) const override;

  KV compress(const LayerInputs& inputs) const override;           // raises: every layer's scores are needed
  at::Tensor keep_mask(const LayerInputs& inputs) const override;  // raises, as compress()

 private:
  DefensiveKVPress layer_press_;  // each layer's scores
};

}  // namespace kvpress
