#include "kvpress/presses/dropkv_press.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "checks.h"
#include "kvpress/ops.h"
#include "layer_slices.h"
#include "presses/registration.h"

namespace kvpress {

namespace {

constexpr const char* kOp = "DropKVPress";

}  // namespace

DropKVPress::DropKVPress(double compression_ratio, const Params& params)
    : ScorerPress(compression_ratio), params_(params) {
  check_params(kOp, params_);
}

at::Tensor DropKVPress::score(const LayerInputs& inputs) const {
  checks::check_kv(kOp, inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  const int64_t window = clamped_window(inputs, params_.window_size);
  const at::Tensor p = ops::window_probabilities(inputs, window, kOp);  // [B, Hq, w, S]
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
