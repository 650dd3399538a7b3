#pragma once

#include <cstdint>

#include "kvpress/press_params.h"
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

  struct Params {
    int64_t window_size = kDefaultWindowSize;
    int64_t kernel_size = kDefaultKernelSize;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"window_size", "number of trailing queries observed (always kept)"}.positive(), self.window_size);
      visit(ParamSpec{"kernel_size", "odd width of the average pooling"}.positive_odd(), self.kernel_size);
    }
  };

  // Raises c10::Error for a parameter outside its declared range.
  SnapKVPress(double compression_ratio, const Params& params);
  explicit SnapKVPress(double compression_ratio = 0.0, int64_t window_size = kDefaultWindowSize,
                       int64_t kernel_size = kDefaultKernelSize)
      : SnapKVPress(compression_ratio, Params{window_size, kernel_size}) {}

  std::string name() const override { return "SnapKVPress"; }
  const Params& params() const { return params_; }
  int64_t window_size() const { return params_.window_size; }
  int64_t kernel_size() const { return params_.kernel_size; }

  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  Params params_;
};

}  // namespace kvpress
