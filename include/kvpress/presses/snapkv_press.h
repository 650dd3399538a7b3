#pragma once

#include <cstdint>

#include "kvpress/presses/base_press.h"

namespace kvpress {

// SnapKV (arXiv 2404.14469): attention of the last window_size queries over the earlier keys,
// averaged over the window, avg-pooled with kernel_size and averaged per GQA group. The window
// itself is always kept. Attention comes from, in order of preference: inputs.attentions (its
// last window_size rows), inputs.queries, or queries recomputed from hidden_states + q_proj.
class SnapKVPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultWindowSize = 64;
  static constexpr int64_t kDefaultKernelSize = 5;

  explicit SnapKVPress(double compression_ratio = 0.0, int64_t window_size = kDefaultWindowSize,
                       int64_t kernel_size = kDefaultKernelSize);

  std::string name() const override { return "SnapKVPress"; }
  int64_t window_size() const { return window_size_; }
  int64_t kernel_size() const { return kernel_size_; }

  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  int64_t window_size_;
  int64_t kernel_size_;
};

}  // namespace kvpress
