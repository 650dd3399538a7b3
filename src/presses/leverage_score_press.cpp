#include "kvpress/presses/leverage_score_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

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

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "LeverageScorePress",
      PressKind::kScorer,
      "ridge leverage of the pre-RoPE keys (Gaussian sketch), z-scored",
      {{{{"cos", "sin"}}, {{"hidden_states", "k_proj"}}}},
      [](double r, ParamReader& p) {
        const int64_t sketch = p.get("sketch_dimension", LeverageScorePress::kDefaultSketchDimension,
                                     "columns of the right Gaussian sketch");
        return std::make_unique<LeverageScorePress>(
            r, sketch,
            p.get_optional_int("seed", "seed of the sketch's CPU generator (kvpress: torch.manual_seed before score)"));
      }};
});

}  // namespace

}  // namespace kvpress
