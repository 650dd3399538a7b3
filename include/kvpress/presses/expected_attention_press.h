#pragma once

#include <cstdint>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Expected attention (kvpress ExpectedAttentionPress): the attention that future queries are
// expected to pay each key. μ and Σ (biased) of the pre-RoPE queries of positions n_sink..S-1 are
// rotated by the RoPE matrix averaged over the next n_future_positions positions (R̄ = mean_t
// cos_t·I + sin_t·P), μ' = R̄μ, Σ' = R̄ΣR̄ᵀ. For keys i >= n_sink:
//   z_i = k_i·μ'/sqrt(D) [+ k_iᵀΣ'k_i / (2D) with use_covariance], softmax over i per query head,
//   group mean, then (s + epsilon)·||v_i|| with use_vnorm; the n_sink first positions get the
//   global max + 1 (always kept).
// Inputs: pre-RoPE queries from hidden_states + q_proj (+ q_norm), else from the given post-RoPE
// queries of all S positions with cos/sin (RoPE inverted). The future RoPE needs inv_freq, else it
// is derived from cos/sin (see LayerInputs::inv_freq). Computed in float32.
class ExpectedAttentionPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultNFuturePositions = 512;
  static constexpr int64_t kDefaultNSink = 4;
  static constexpr bool kDefaultUseCovariance = true;
  static constexpr bool kDefaultUseVnorm = true;
  static constexpr double kDefaultEpsilon = 0.0;

  struct Params {
    int64_t n_future_positions = kDefaultNFuturePositions;
    int64_t n_sink = kDefaultNSink;
    bool use_covariance = kDefaultUseCovariance;
    bool use_vnorm = kDefaultUseVnorm;
    double epsilon = kDefaultEpsilon;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"n_future_positions", "future positions the RoPE is averaged over"}.positive(),
            self.n_future_positions);
      visit(ParamSpec{"n_sink", "first tokens always kept and left out of the query statistics"}.non_negative(),
            self.n_sink);
      visit(ParamSpec{"use_covariance", "add the query covariance term"}, self.use_covariance);
      visit(ParamSpec{"use_vnorm", "rescale by ||v||"}, self.use_vnorm);
      visit(ParamSpec{"epsilon", "added to the scores before the ||v|| rescaling"}.non_negative(), self.epsilon);
    }
  };

  // Raises c10::Error for a parameter outside its declared range.
  ExpectedAttentionPress(double compression_ratio, const Params& params);
  explicit ExpectedAttentionPress(double compression_ratio = 0.0, int64_t n_future_positions = kDefaultNFuturePositions,
                                  int64_t n_sink = kDefaultNSink, bool use_covariance = kDefaultUseCovariance,
                                  bool use_vnorm = kDefaultUseVnorm, double epsilon = kDefaultEpsilon)
      : ExpectedAttentionPress(compression_ratio,
                               Params{n_future_positions, n_sink, use_covariance, use_vnorm, epsilon}) {}

  std::string name() const override { return "ExpectedAttentionPress"; }
  const Params& params() const { return params_; }
  int64_t n_future_positions() const { return params_.n_future_positions; }
  int64_t n_sink() const { return params_.n_sink; }
  bool use_covariance() const { return params_.use_covariance; }
  bool use_vnorm() const { return params_.use_vnorm; }
  double epsilon() const { return params_.epsilon; }

  at::Tensor score(const LayerInputs& inputs) const override;  // -> [B, Hkv, S] float32

 protected:
  // The scores from the pre-RoPE queries' statistics: query_mean [B, Hq, D] float32, query_cov
  // [B, Hq, D, D] float32 (undefined without use_covariance). Checks done by the caller: keys and
  // values, S > n_sink, even D, Hq a multiple of Hkv.
  at::Tensor score_from_statistics(const LayerInputs& inputs, const at::Tensor& query_mean,
                                   const at::Tensor& query_cov) const;  // -> [B, Hkv, S] float32

 private:
  Params params_;
};

}  // namespace kvpress
