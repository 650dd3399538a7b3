#include "kvpress/presses/leverage_score_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "kvpress/ops.h"

namespace kvpress {

LeverageScorePress::LeverageScorePress(double compression_ratio, int64_t sketch_dimension, std::optional<int64_t> seed)
    : ScorerPress(compression_ratio), sketch_dimension_(sketch_dimension), seed_(seed) {
  checks::check_positive("LeverageScorePress", "sketch_dimension", sketch_dimension);
  if (seed) checks::check_non_negative("LeverageScorePress", "seed", *seed);
}

at::Tensor LeverageScorePress::score(const LayerInputs& inputs) const {
  constexpr const char* op = "LeverageScorePress";
  checks::check_kv(op, inputs.keys, inputs.values);
  return ops::zscore(ops::leverage_scores(inputs, sketch_dimension_, seed_.value_or(-1), op));
}

}  // namespace kvpress
