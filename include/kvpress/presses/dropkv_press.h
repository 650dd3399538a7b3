#pragma once

#include <cstdint>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// DropKV (decoupled residual-output perturbation; openreview.net/forum?id=MqfNzH3TVH, proposed to
// kvpress as DropKVPress in NVIDIA/kvpress#285, not in kvpress 0.5.5). Evicting token j alone moves
// query i's attention output by p_ij / (1 - p_ij) · (o_i - v_j), so a token scores the squared
// perturbation summed over the last w queries:
//   s_j = Σ_i (p_ij / (1 - p_ij + epsilon))² · ‖v_j - o_i‖²,   o_i = Σ_k p_ik v_k,
// averaged over each GQA group, avg-pooled over kernel_size positions (zero padded, as SnapKV),
// and the last w positions always kept. w = window_size clamped to the query rows the inputs hold
// and to S. p is the given attentions' last w rows, else the causal softmax of the window queries.
class DropKVPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultWindowSize = 32;
  static constexpr int64_t kDefaultKernelSize = 7;
  static constexpr double kDefaultEpsilon = 1e-6;

  struct Params {
    int64_t window_size = kDefaultWindowSize;
    int64_t kernel_size = kDefaultKernelSize;
    double epsilon = kDefaultEpsilon;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"window_size", "trailing queries observed (always kept; clamped to the query rows given)"}
                .positive(),
            self.window_size);
      visit(ParamSpec{"kernel_size", "odd width of the average pooling"}.positive_odd(), self.kernel_size);
      visit(ParamSpec{"epsilon", "added to 1 - p in the sensitivity weight"}.positive(), self.epsilon);
    }
  };

  // Raises c10::Error for a parameter outside its declared range.
  DropKVPress(double compression_ratio, const Params& params);
  explicit DropKVPress(double compression_ratio = 0.0, int64_t window_size = kDefaultWindowSize,
                       int64_t kernel_size = kDefaultKernelSize, double epsilon = kDefaultEpsilon)
      : DropKVPress(compression_ratio, Params{window_size, kernel_size, epsilon}) {}

  std::string name() const override { return "DropKVPress"; }
  const Params& params() const { return params_; }

  at::Tensor score(const LayerInputs& inputs) const override;  // -> [B, Hkv, S] float32

 private:
  Params params_;
};

}  // namespace kvpress
