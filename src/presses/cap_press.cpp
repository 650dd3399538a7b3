// CapPress (kvpress 0.5.5's CAPKV press). docs/PRESS_NOTES.md lists where it differs from kvpress.
#include "kvpress/presses/cap_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

// x / max(||x||, 1e-12) along the last dimension (F.normalize).
at::Tensor unit_rows(const at::Tensor& x) { return x / at::linalg_vector_norm(x, 2, {-1}, true).clamp_min(1e-12); }

}  // namespace

CapPress::CapPress(double compression_ratio, const Params& params)
    : CapPress(compression_ratio, params.tau, params.n_future_positions, params.n_sink, params.epsilon) {}

CapPress::CapPress(double compression_ratio, double tau, int64_t n_future_positions, int64_t n_sink, double epsilon)
    : ScorerPress(compression_ratio),
      tau_(tau),
      n_future_positions_(n_future_positions),
      n_sink_(n_sink),
      epsilon_(epsilon) {
  check_params("CapPress", Params{tau, n_future_positions, n_sink, epsilon});
}

at::Tensor CapPress::score(const LayerInputs& in) const {
  constexpr const char* op = "CapPress";
  checks::check_kv(op, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  TORCH_CHECK(seq > n_sink_, op, ": seq_len must be > n_sink (", n_sink_, "), got ", seq);
  const int64_t n = seq - n_sink_;

  // The anchor: mean over positions of the pre-RoPE queries times R̄ᵀ. The product is linear, so the
  // queries are summed first (chunk by chunk, in float64) and multiplied once: [B, Hq, D] x [D, D]
  // instead of kvpress's [B, Hq, n, D] x [D, D] (2·Hq·n·D² = 17 GFLOP at the Llama-3.1-8B shape).
  const at::Tensor rotation_t = ops::average_rope_rotation(ops::rope_inv_freq(in, op), seq, n_future_positions_).t();
  int64_t heads = 0;
  at::Tensor query_sum;  // [B, Hq, D] float64
  ops::for_each_prerope_query_chunk(in, n_sink_, n, op, [&](const at::Tensor& q, int64_t offset) {
    const at::Tensor part = q.sum(2, /*keepdim=*/false, at::kDouble);
    if (offset == 0) {
      heads = q.size(1);
      checks::check_gqa(op, heads, kv_heads);
      query_sum = part;
    } else {
      query_sum += part;
    }
  });
  const int64_t group = heads / kv_heads;
  const at::Tensor anchor = unit_rows(
      at::matmul(query_sum / static_cast<double>(n), rotation_t.to(at::kDouble)).to(at::kFloat));  // [B, Hq, D]

  at::Tensor scores = at::empty({batch, kv_heads, n}, anchor.options());
  const at::Tensor eye = at::eye(d, anchor.options());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const at::Tensor k = unit_rows(in.keys[b][h].narrow(0, n_sink_, n).to(at::kFloat));  // [n, D]
      const at::Tensor v = in.values[b][h].narrow(0, n_sink_, n).to(at::kFloat);           // [n, D]
      // Query relevance of each token for the group's query heads: [G, n].
      at::Tensor logits = at::matmul(anchor[b].narrow(0, h * group, group), k.t()).clamp_(-1.0, 1.0).mul_(tau_);
      const at::Tensor weights = (logits - logits.amax(-1, /*keepdim=*/true)).exp_();
      at::Tensor head_scores = at::zeros({n}, anchor.options());
      const at::Tensor rows = v.view({1, 1, n, d});
      for (int64_t g = 0; g < group; ++g) {
        const at::Tensor scaled = v * (weights[g] + epsilon_).sqrt_().unsqueeze(1);  // [n, D]
        // A = I + Σ w_i v_i v_iᵀ is symmetric with every eigenvalue >= 1: v_iᵀ A⁻¹ v_i = ||L⁻¹ v_i||² with
        // A = L Lᵀ (kvpress solves A X = Vᵀ by LU; the two agree to float rounding).
        const at::Tensor factor = at::linalg_cholesky(at::addmm(eye, scaled.t(), scaled));  // [D, D]
        head_scores += weights[g] * ops::cholesky_leverage(rows, factor.view({1, 1, d, d})).view({n});
      }
      scores[b][h].copy_(head_scores / static_cast<double>(group));
    }
  }
  if (n_sink_ == 0) return scores;
  const double pad = scores.max().item<double>() + 1.0;
  return at::cat({at::full({batch, kv_heads, n_sink_}, pad, scores.options()), scores}, 2).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"CapPress", PressKind::kScorer,
                    "CAPKV: capacity leverage of the values under query relevance (averaged-RoPE query anchor)",
                    pre_rope_query_inputs(), from_params<CapPress>};
});

}  // namespace

}  // namespace kvpress
