#include "kvpress/presses/criticalkv_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
CriticalKVPress::CriticalKVPress(std::shared_ptr<const ScorerPress> press, double epsilon, double first_stage_ratio)
    : ScorerPress(press ? press->compression_ratio() : 0.0),
      press_(std::move(press)),
      epsilon_(epsilon),
      first_stage_ratio_(first_stage_ratio) {
  check_params("CriticalKVPress", Params{epsilon, first_stage_ratio});
  TORCH_CHECK(press_ != nullptr, "CriticalKVPress: press must be a ScorerPress, got nullptr");
}

at::Tensor CriticalKVPress::output_projected_value_norms(const LayerInputs& in, const char* op) {
  checks::check_kv(op, in.keys, in.values);
  TORCH_CHECK(in.o_proj.defined(), op,
              ": needs o_proj (the layer's output projection weight [hidden, num_heads * head_dim]); none was given");
  checks::check_rank(op, "o_proj", in.o_proj, 2, "[hidden, num_heads * head_dim]");
  int64_t heads = in.num_heads;
  if (heads <= 0) {
    const int64_t d = in.values.size(3);
    const bool known = in.queries.defined() || in.attentions.defined() || in.q_proj.defined();
    heads = known ? ops::num_query_heads(in) : (in.o_proj.size(1) % d == 0 ? in.o_proj.size(1) / d : 0);
  }
  checks::check_output_projection(op, in.values, in.o_proj, heads);  // errors under the press's name
  return ops::output_projected_l1_norms(in.values, in.o_proj, heads);
}

at::Tensor CriticalKVPress::score(const LayerInputs& in) const {
  constexpr const char* op = "CriticalKVPress";
  checks::check_kv(op, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const double ratio = compression_ratio();
  const at::Tensor scores = budget::inner_scores(*press_, in, op);
  // Stage 1 budget, as kvpress: int((1 - ratio) · S · first_stage_ratio), floored to 1.
  int64_t first = static_cast<int64_t>((1.0 - ratio) * static_cast<double>(seq) * first_stage_ratio_);
  if (first_stage_ratio_ > 0) first = ratio < 1.0 ? std::max<int64_t>(1, first) : 0;
  first = std::min(first, seq);
  const at::Tensor norms = output_projected_value_norms(in, op);
  const at::Tensor rescaled = (scores + epsilon_) * norms;
  if (first == 0) return rescaled;
  const at::Tensor stage1 =
      budget::keep_top_per_row(scores, at::full({batch, kv_heads}, first, scores.options().dtype(at::kLong)));
  return rescaled.masked_fill(stage1, std::numeric_limits<float>::max());
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"CriticalKVPress",
                    PressKind::kWrapper,
                    "inner scores x ||v W_o||_1, the first stage's winners kept",
                    {{}, {"o_proj"}},
                    wrapper_from_params<CriticalKVPress>};
});

}  // namespace

}  // namespace kvpress
