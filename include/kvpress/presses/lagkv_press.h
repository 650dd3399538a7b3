#pragma once

#include <cstdint>

#include "kvpress/ops.h"
#include "kvpress/press_params.h"
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

  struct Params {
    int64_t n_sink = kDefaultNSink;
    int64_t lag_size = kDefaultLagSize;
    bool cross_scoring = kDefaultCrossScoring;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"n_sink", "number of initial tokens always kept"}.non_negative(), self.n_sink);
      visit(ParamSpec{"lag_size", "partition length"}.positive(), self.lag_size);
      visit(ParamSpec{"cross_scoring", "compare raw scores across partitions instead of ranks"}, self.cross_scoring);
    }
  };

  // Raises c10::Error for a parameter outside its declared range.
  LagKVPress(double compression_ratio, const Params& params);
  explicit LagKVPress(double compression_ratio = 0.0, int64_t n_sink = kDefaultNSink,
                      int64_t lag_size = kDefaultLagSize, bool cross_scoring = kDefaultCrossScoring)
      : LagKVPress(compression_ratio, Params{n_sink, lag_size, cross_scoring}) {}

  std::string name() const override { return "LagKVPress"; }
  int64_t n_sink() const { return params_.n_sink; }
  int64_t lag_size() const { return params_.lag_size; }
  bool cross_scoring() const { return params_.cross_scoring; }

  at::Tensor score(const LayerInputs& inputs) const override {
    return ops::lagkv_scores(inputs.keys, inputs.values, params_.n_sink, params_.lag_size, params_.cross_scoring);
  }

 private:
  Params params_;
};

}  // namespace kvpress
