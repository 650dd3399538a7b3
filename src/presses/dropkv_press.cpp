#include "kvpress/presses/dropkv_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

namespace {

constexpr const char* kOp = "DropKVPress";

// Query rows the inputs hold (kvpress: the forward's q_len, hidden_states.shape[1]).
int64_t query_rows(const LayerInputs& in) {
  if (in.attentions.defined()) return in.attentions.size(2);
  if (in.queries.defined()) return in.queries.size(2);
  if (in.hidden_states.defined()) return in.hidden_states.size(1);
  return in.keys.size(2);
}

// Attention probabilities of the last `window` queries over every key, the window's own columns
// included (o_i needs them): the given attentions' rows, else the causal softmax of window_queries
// in float32, query heads of a group folded into rows.
at::Tensor window_probabilities(const LayerInputs& in, int64_t window) {  // -> [B, Hq, w, S] float32
  const at::Tensor& keys = in.keys;
  const int64_t seq = keys.size(2);
  if (in.attentions.defined()) {
    const at::Tensor& a = in.attentions;
    checks::check_rank(kOp, "attentions", a, 4, "[batch, num_heads, q_len, seq_len]");
    checks::check_same_device(kOp, "attentions", a, "keys", keys);
    TORCH_CHECK(a.size(0) == keys.size(0) && a.size(3) == seq, kOp, ": attentions must be [", keys.size(0),
                ", num_heads, q_len, ", seq, "] to match keys, got ", checks::shape_str(a));
    checks::check_gqa(kOp, a.size(1), keys.size(1));
    return a.narrow(2, a.size(2) - window, window).to(at::kFloat);
  }
  const at::Tensor q = ops::window_queries(in, window, kOp).to(at::kFloat);  // [B, Hq, w, D]
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), head_dim = keys.size(3), heads = q.size(1);
  const at::Tensor logits =
      at::matmul(q.reshape({batch, kv_heads, heads / kv_heads * window, head_dim}), keys.to(at::kFloat).transpose(2, 3))
          .mul_(1.0 / std::sqrt(static_cast<double>(head_dim)))
          .view({batch, heads, window, seq});
  // Query i sits at position seq - window + i and sees keys 0..seq - window + i.
  const at::Tensor future = at::ones({window, seq}, keys.options().dtype(at::kBool)).triu(seq - window + 1);
  return at::softmax(logits.masked_fill_(future, -std::numeric_limits<float>::infinity()), -1);
}

}  // namespace

DropKVPress::DropKVPress(double compression_ratio, const Params& params)
    : ScorerPress(compression_ratio), params_(params) {
  check_params(kOp, params_);
}

at::Tensor DropKVPress::score(const LayerInputs& inputs) const {
  checks::check_kv(kOp, inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  const int64_t window = std::max<int64_t>(1, std::min({params_.window_size, query_rows(inputs), seq}));
  const at::Tensor p = window_probabilities(inputs, window);
  const int64_t group = p.size(1) / kv_heads;
  // A KV head's rows: its group's query heads times the window, [B, Hkv, g·w, S].
  const at::Tensor probs = p.reshape({batch, kv_heads, group * window, seq});
  const at::Tensor v = inputs.values.to(at::kFloat);  // [B, Hkv, S, D]
  const at::Tensor out = at::matmul(probs, v);        // o_i, [B, Hkv, g·w, D]
  const at::Tensor weight = (probs / (1.0 - probs + params_.epsilon)).square();
  // Σ_i w_ij ‖v_j − o_i‖² = (Σ_i w_ij)‖v_j‖² − 2 v_j·(Σ_i w_ij o_i) + Σ_i w_ij ‖o_i‖², as GEMMs over i.
  const at::Tensor weight_t = weight.transpose(2, 3);  // [B, Hkv, S, g·w]
  const at::Tensor scores = weight.sum(2) * v.square().sum(-1) - 2.0 * (v * at::matmul(weight_t, out)).sum(-1) +
                            at::matmul(weight_t, out.square().sum(-1, /*keepdim=*/true)).squeeze(-1);
  // Group mean, then SnapKV's pooling: zero padded, the padding counted.
  at::Tensor pooled = at::avg_pool1d(scores / static_cast<double>(group), {params_.kernel_size}, {1},
                                     {params_.kernel_size / 2}, /*ceil_mode=*/false, /*count_include_pad=*/true);
  pooled.narrow(2, seq - window, window)
      .copy_(std::get<0>(pooled.max(2, /*keepdim=*/true)).add(1.0).expand({-1, -1, window}));
  return pooled;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"DropKVPress", PressKind::kScorer,
                    "squared attention-output perturbation of evicting each token alone, over the last queries",
                    window_attention_inputs(), from_params<DropKVPress>};
});

}  // namespace

}  // namespace kvpress
