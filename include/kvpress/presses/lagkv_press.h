#pragma once

#include <cstdint>

#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// LagKV (arXiv 2504.04704): scores each lag-sized partition of K and V against the min/max of
// the next partition. Sinks and the last partition (plus remainder) are always kept; inputs
// shorter than n_sink + 2 * lag_size get a ramp that keeps sinks and the most recent tokens.
class LagKVPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultNSink = 4;
  static constexpr int64_t kDefaultLagSize = 128;
  static constexpr bool kDefaultCrossScoring = false;

  explicit LagKVPress(double compression_ratio = 0.0, int64_t n_sink = kDefaultNSink,
                      int64_t lag_size = kDefaultLagSize, bool cross_scoring = kDefaultCrossScoring);

  std::string name() const override { return "LagKVPress"; }
  int64_t n_sink() const { return n_sink_; }
  int64_t lag_size() const { return lag_size_; }
  bool cross_scoring() const { return cross_scoring_; }

  at::Tensor score(const LayerInputs& inputs) const override {
    return ops::lagkv_scores(inputs.keys, inputs.values, n_sink_, lag_size_, cross_scoring_);
  }

 private:
  int64_t n_sink_;
  int64_t lag_size_;
  bool cross_scoring_;
};

}  // namespace kvpress
