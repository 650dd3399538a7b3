#include "kvpress/presses/random_press.h"

#include "head_exchange.h"
#include "presses/registration.h"

namespace kvpress {

at::Tensor RandomPress::score(const LayerInputs& inputs) const {
  const int64_t seed = params_.seed.value_or(-1);
  if (inputs.kv_head_range.layer_kv_heads == 0) return ops::random_scores(inputs.keys, seed);
  // The draw is shaped like the whole layer's keys (a view: one head's memory, every head's shape).
  const at::Tensor& k = inputs.keys;
  const at::Tensor layer_keys =
      k.narrow(1, 0, 1).expand({k.size(0), head_exchange::layer_kv_heads(inputs), k.size(2), k.size(3)});
  return head_exchange::own_rows("RandomPress.score", "the draw", ops::random_scores(layer_keys, seed), 1, inputs)
      .contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "RandomPress", PressKind::kScorer, "uniform random scores (baseline)", {}, from_params<RandomPress>};
});

}  // namespace

}  // namespace kvpress
