#include "kvpress/presses/non_causal_attn_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

NonCausalAttnPress::NonCausalAttnPress(double compression_ratio, const Params& params)
    : NonCausalAttnPress(compression_ratio, params.chunk_size) {}

NonCausalAttnPress::NonCausalAttnPress(double compression_ratio, int64_t chunk_size)
    : ScorerPress(compression_ratio), chunk_size_(chunk_size) {
  check_params("NonCausalAttnPress", Params{chunk_size});
}

at::Tensor NonCausalAttnPress::score(const LayerInputs& inputs) const {
  constexpr const char* op = "NonCausalAttnPress";
  checks::check_kv(op, inputs.keys, inputs.values);
  const at::Tensor sums = ops::noncausal_column_sums(inputs, chunk_size_, op);
  // z-scored over every head of the layer (on a rank's share, the layer's mean and deviation).
  return head_exchange::zscore(inputs, ops::noncausal_attention_pooled(sums, inputs.values));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"NonCausalAttnPress", PressKind::kScorer,
                    "chunked non-causal attention received, x ||v||, pooled, z-scored", all_query_inputs(),
                    from_params<NonCausalAttnPress>};
});

}  // namespace

}  // namespace kvpress
