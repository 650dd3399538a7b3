#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// CriticalAdaKVPress (kvpress; arXiv 2502.03805): AdaKV's head budgets with CriticalKV's two
// stages inside each head. The inner scores get AdaKV's safeguard (top n_safe per head forced to
// float max); each head's budget is its share of the Hkv · n_kept best (head, position) pairs of
// the batch row; stage 1 forces the head's top int(budget · first_stage_ratio) positions (the
// product in float32, as kvpress's tensor arithmetic); stage 2 rescores (score + epsilon) · N_i
// (N: CriticalKVPress::output_projected_value_norms, needs LayerInputs::o_proj) and the head
// keeps its `budget` best. kvpress then masks the other positions; here the heads are stored
// head-ragged, so compress() raises and compress_ragged() returns the per-head kept tokens.
// Budgets are counted per batch row (kvpress sums them over the batch; identical for B = 1).
// The compression ratio is the inner press's.
class CriticalAdaKVPress : public HeadRaggedWrapperPress {
 public:
  // Raises unless press is non-null, 0 <= alpha_safeguard <= 1, epsilon is finite and
  // 0 <= first_stage_ratio <= 1.
  static constexpr double kDefaultAlphaSafeguard = 0.20;
  static constexpr double kDefaultEpsilon = 1e-4;
  static constexpr double kDefaultFirstStageRatio = 0.5;

  // Its parameters besides the inner press.
  struct Params {
    double alpha_safeguard = kDefaultAlphaSafeguard;
    double epsilon = kDefaultEpsilon;
    double first_stage_ratio = kDefaultFirstStageRatio;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"alpha_safeguard", "fraction of n_kept every head keeps at least"}.fraction(),
            self.alpha_safeguard);
      visit(ParamSpec{"epsilon", "added to the inner scores before the rescaling"}, self.epsilon);
      visit(
          ParamSpec{"first_stage_ratio", "fraction of each head's budget chosen by the inner scores alone"}.fraction(),
          self.first_stage_ratio);
    }
  };

  explicit CriticalAdaKVPress(std::shared_ptr<const ScorerPress> press, double alpha_safeguard = kDefaultAlphaSafeguard,
                              double epsilon = kDefaultEpsilon, double first_stage_ratio = kDefaultFirstStageRatio);
  // The registry's form: its Params (kvpress/press_params.h).
  CriticalAdaKVPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : CriticalAdaKVPress(std::move(press), params.alpha_safeguard, params.epsilon, params.first_stage_ratio) {}

  std::string name() const override { return "CriticalAdaKVPress"; }
  // Budgets across every head: on a rank's share, the inner scores of every head are exchanged.
  HeadSpan head_span() const override { return wider_span(HeadSpan::kExchanged, press()->head_span()); }

  // [B, Hkv, S] bool: the kept positions (the complement of kvpress's masked_key_indices);
  // compress_ragged() gathers them, compress() raises.
  at::Tensor keep_mask(const LayerInputs& inputs) const override;

  double alpha_safeguard() const { return alpha_safeguard_; }
  double epsilon() const { return epsilon_; }
  double first_stage_ratio() const { return first_stage_ratio_; }

 private:
  double alpha_safeguard_;
  double epsilon_;
  double first_stage_ratio_;
};

}  // namespace kvpress
