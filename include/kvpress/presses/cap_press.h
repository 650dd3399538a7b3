#pragma once

#include <cstdint>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// CAPKV (kvpress 0.5.5's CapPress): token i's capacity leverage under query relevance. Per query
// head: the anchor μ = mean of the pre-RoPE queries of positions n_sink..S-1 rotated by the RoPE
// averaged over the next n_future_positions positions; w_i = exp(τ·cos(μ, k_i) - max); A = I +
// Σ_i (w_i + ε) v_i v_iᵀ; s_i = w_i · v_iᵀ A⁻¹ v_i; group mean; the n_sink first positions get the
// global max + 1. Inputs as ExpectedAttentionPress. Computed in float32.
class CapPress : public ScorerPress {
 public:
  static constexpr double kDefaultTau = 5.0;
  static constexpr int64_t kDefaultNFuturePositions = 512;
  static constexpr int64_t kDefaultNSink = 4;
  static constexpr double kDefaultEpsilon = 1e-6;

  struct Params {
    double tau = kDefaultTau;
    int64_t n_future_positions = kDefaultNFuturePositions;
    int64_t n_sink = kDefaultNSink;
    double epsilon = kDefaultEpsilon;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"tau", "temperature of the query-key alignment weights"}, self.tau);
      visit(ParamSpec{"n_future_positions", "future positions the RoPE is averaged over"}.positive(),
            self.n_future_positions);
      visit(ParamSpec{"n_sink", "first tokens always kept and left out of the query anchor"}.non_negative(),
            self.n_sink);
      visit(ParamSpec{"epsilon", "added to the weights in the capacity matrix"}.non_negative(), self.epsilon);
    }
  };

  // Raises as the constructor below.
  CapPress(double compression_ratio, const Params& params);
  explicit CapPress(double compression_ratio = 0.0, double tau = kDefaultTau,
                    int64_t n_future_positions = kDefaultNFuturePositions, int64_t n_sink = kDefaultNSink,
                    double epsilon = kDefaultEpsilon);

  std::string name() const override { return "CapPress"; }
  double tau() const { return tau_; }
  int64_t n_future_positions() const { return n_future_positions_; }
  int64_t n_sink() const { return n_sink_; }
  double epsilon() const { return epsilon_; }

  at::Tensor score(const LayerInputs& inputs) const override;  // -> [B, Hkv, S] float32

 private:
  double tau_;
  int64_t n_future_positions_;
  int64_t n_sink_;
  double epsilon_;
};

}  // namespace kvpress
