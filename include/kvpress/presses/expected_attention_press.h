#pragma once

#include <cstdint>

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

  explicit ExpectedAttentionPress(double compression_ratio = 0.0, int64_t n_future_positions = kDefaultNFuturePositions,
                                  int64_t n_sink = kDefaultNSink, bool use_covariance = kDefaultUseCovariance,
                                  bool use_vnorm = kDefaultUseVnorm, double epsilon = kDefaultEpsilon);

  std::string name() const override { return "ExpectedAttentionPress"; }
  int64_t n_future_positions() const { return n_future_positions_; }
  int64_t n_sink() const { return n_sink_; }
  bool use_covariance() const { return use_covariance_; }
  bool use_vnorm() const { return use_vnorm_; }
  double epsilon() const { return epsilon_; }

  at::Tensor score(const LayerInputs& inputs) const override;  // -> [B, Hkv, S] float32

 protected:
  // The scores from the pre-RoPE queries' statistics: query_mean [B, Hq, D] float32, query_cov
  // [B, Hq, D, D] float32 (undefined without use_covariance). Checks done by the caller: keys and
  // values, S > n_sink, even D, Hq a multiple of Hkv.
  at::Tensor score_from_statistics(const LayerInputs& inputs, const at::Tensor& query_mean,
                                   const at::Tensor& query_cov) const;  // -> [B, Hkv, S] float32

 private:
  int64_t n_future_positions_;
  int64_t n_sink_;
  bool use_covariance_;
  bool use_vnorm_;
  double epsilon_;
};

}  // namespace kvpress
