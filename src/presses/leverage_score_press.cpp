#include "kvpress/presses/leverage_score_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

LeverageScorePress::LeverageScorePress(double compression_ratio, const Params& params)
    : LeverageScorePress(compression_ratio, params.sketch_dimension, params.seed) {}

LeverageScorePress::LeverageScorePress(double compression_ratio, int64_t sketch_dimension, std::optional<int64_t> seed)
    : ScorerPress(compression_ratio), sketch_dimension_(sketch_dimension), seed_(seed) {
  check_params("LeverageScorePress", Params{sketch_dimension, seed});
}

at::Tensor LeverageScorePress::score(const LayerInputs& inputs) const {
  constexpr const char* op = "LeverageScorePress";
  checks::check_kv(op, inputs.keys, inputs.values);
  // z-scored over every head of the layer (on a rank's share, the layer's mean and deviation).
  return head_exchange::zscore(inputs, ops::leverage_scores(inputs, sketch_dimension_, seed_.value_or(-1), op));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"LeverageScorePress",
                    PressKind::kScorer,
                    "ridge leverage of the pre-RoPE keys (Gaussian sketch), z-scored",
                    {{{{"cos", "sin"}}, {{"hidden_states", "k_proj"}}}},
                    from_params<LeverageScorePress>};
});

}  // namespace

}  // namespace kvpress
