#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// CriticalKVPress (kvpress; arXiv 2502.03805): two-stage selection that weighs the inner scorer's
// scores by how much each value moves the attention output. Stage 1: the top
// int((1 - ratio) · S · first_stage_ratio) positions of every head by the inner scores (at least 1
// when first_stage_ratio > 0) are kept whatever happens. Stage 2: score = (inner + epsilon) · N_i
// with N_i the mean over the head's GQA group of ||v_i · W_o^h||_1 (W_o^h: query head h's
// [D, hidden] slice of o_proj); stage-1 winners get float max; the usual top n_kept per head.
// Needs LayerInputs::o_proj. kvpress advises ExpectedAttentionPress with use_vnorm=false inside.
// The compression ratio is the inner press's (set_compression_ratio changes only this press's
// selection, not the inner scorer's own ratio-dependent scores).
class CriticalKVPress : public ScorerPress {
 public:
  // Raises unless press is non-null, epsilon is finite and 0 <= first_stage_ratio <= 1.
  static constexpr double kDefaultEpsilon = 1e-4;
  static constexpr double kDefaultFirstStageRatio = 0.5;

  // Its parameters besides the inner press.
  struct Params {
    double epsilon = kDefaultEpsilon;
    double first_stage_ratio = kDefaultFirstStageRatio;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"epsilon", "added to the inner scores before the rescaling"}, self.epsilon);
      visit(ParamSpec{"first_stage_ratio", "fraction of the budget chosen by the inner scores alone"}.fraction(),
            self.first_stage_ratio);
    }
  };

  explicit CriticalKVPress(std::shared_ptr<const ScorerPress> press, double epsilon = kDefaultEpsilon,
                           double first_stage_ratio = kDefaultFirstStageRatio);
  // The registry's form: its Params (kvpress/press_params.h).
  CriticalKVPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : CriticalKVPress(std::move(press), params.epsilon, params.first_stage_ratio) {}

  std::string name() const override { return "CriticalKVPress"; }
  at::Tensor score(const LayerInputs& inputs) const override;

  const std::shared_ptr<const ScorerPress>& press() const { return press_; }
  double epsilon() const { return epsilon_; }
  double first_stage_ratio() const { return first_stage_ratio_; }

  // kvpress's vwl1norm: N[b, j, i] = mean over the query heads h of KV head j's group of
  // ||values[b, j, i] · W_o^h||_1, W_o^h = o_proj[:, h·D:(h+1)·D]ᵀ. float32, computed a block of
  // positions at a time. Hq is inputs.num_heads, else inferred (queries, attentions, q_proj, or
  // o_proj's width / D). `op` prefixes error messages.
  static at::Tensor output_projected_value_norms(const LayerInputs& inputs, const char* op);  // -> [B, Hkv, S]

 private:
  std::shared_ptr<const ScorerPress> press_;
  double epsilon_;
  double first_stage_ratio_;
};

}  // namespace kvpress
