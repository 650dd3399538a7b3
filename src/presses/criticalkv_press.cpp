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
namespace {

// Rows of V·W_o evaluated at once: bounds the [rows, G·hidden] intermediate to 4M floats (16 MiB).
constexpr int64_t kMaxProductElements = int64_t{1} << 22;

}  // namespace

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
  const int64_t batch = in.values.size(0), kv_heads = in.values.size(1), seq = in.values.size(2), d = in.values.size(3);
  TORCH_CHECK(in.o_proj.defined(), op,
              ": needs o_proj (the layer's output projection weight [hidden, num_heads * head_dim]); none was given");
  checks::check_rank(op, "o_proj", in.o_proj, 2, "[hidden, num_heads * head_dim]");
  checks::check_float(op, "o_proj", in.o_proj);
  checks::check_same_device(op, "o_proj", in.o_proj, "values", in.values);
  int64_t heads = in.num_heads;
  if (heads <= 0) {
    const bool known = in.queries.defined() || in.attentions.defined() || in.q_proj.defined();
    heads = known ? ops::num_query_heads(in) : (in.o_proj.size(1) % d == 0 ? in.o_proj.size(1) / d : 0);
  }
  checks::check_gqa(op, heads, kv_heads);
  const int64_t hidden = in.o_proj.size(0), groups = heads / kv_heads;
  TORCH_CHECK(in.o_proj.size(1) == heads * d && hidden > 0, op, ": o_proj must be [hidden, ", heads * d,
              "] (num_heads * head_dim), got ", checks::shape_str(in.o_proj));
  const int64_t block = std::max<int64_t>(1, kMaxProductElements / (groups * hidden * std::max<int64_t>(batch, 1)));
  std::vector<at::Tensor> per_head;
  per_head.reserve(static_cast<size_t>(kv_heads));
  for (int64_t j = 0; j < kv_heads; ++j) {
    // Query heads j·G .. j·G+G-1 read KV head j (repeat_kv); their W_o^h side by side: [D, G·hidden].
    const at::Tensor w = in.o_proj.narrow(1, j * groups * d, groups * d)
                             .to(at::kFloat)
                             .view({hidden, groups, d})
                             .permute({2, 1, 0})
                             .reshape({d, groups * hidden});
    const at::Tensor v = in.values.select(1, j).to(at::kFloat);  // [B, S, D]
    std::vector<at::Tensor> blocks;
    for (int64_t start = 0; start < seq; start += block) {
      const int64_t n = std::min(block, seq - start);
      const at::Tensor prod = at::matmul(v.narrow(1, start, n), w).view({batch, n, groups, hidden});
      // L1 over hidden in one reduction (no |prod| temporary), mean over the group: [B, n].
      blocks.push_back(at::linalg_vector_norm(prod, 1, {-1}).mean(-1));
    }
    per_head.push_back(at::cat(blocks, 1));
  }
  return at::stack(per_head, 1);  // [B, Hkv, S]
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
