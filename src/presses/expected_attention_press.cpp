#include "kvpress/presses/expected_attention_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

ExpectedAttentionPress::ExpectedAttentionPress(double compression_ratio, const Params& params)
    : ScorerPress(compression_ratio), params_(params) {
  check_params("ExpectedAttentionPress", params_);
}

at::Tensor ExpectedAttentionPress::score(const LayerInputs& in) const {
  constexpr const char* op = "ExpectedAttentionPress";
  checks::check_kv(op, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  TORCH_CHECK(seq > params_.n_sink, op, ": seq_len must be > n_sink (", params_.n_sink, "), got ", seq);
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even for RoPE, got ", d);
  const int64_t n = seq - params_.n_sink;

  // Query statistics over positions n_sink..S-1 (mean, biased covariance), accumulated chunk by
  // chunk in float64, the sums shifted by the first chunk's mean for accuracy.
  int64_t heads = 0;
  at::Tensor shift, sum, second;  // [B, Hq, 1, D], [B, Hq, D], [B, Hq, D, D]
  ops::for_each_prerope_query_chunk(in, params_.n_sink, n, op, [&](const at::Tensor& q, int64_t offset) {
    if (offset == 0) {
      heads = q.size(1);
      checks::check_gqa(op, heads, kv_heads);
      shift = q.mean(2, true);
      sum = at::zeros({batch, heads, d}, q.options().dtype(at::kDouble));
      if (params_.use_covariance) second = at::zeros({batch, heads, d, d}, sum.options());
    }
    const at::Tensor qc = q - shift;  // [B, Hq, rows, D]
    sum += qc.sum(2).to(at::kDouble);
    if (params_.use_covariance) second += at::matmul(qc.transpose(2, 3), qc).to(at::kDouble);
  });
  const at::Tensor mean_shifted = sum / static_cast<double>(n);  // [B, Hq, D] float64
  const at::Tensor mu = (shift.squeeze(2).to(at::kDouble) + mean_shifted).to(at::kFloat);
  at::Tensor cov;
  if (params_.use_covariance) {
    const at::Tensor outer = mean_shifted.unsqueeze(-1) * mean_shifted.unsqueeze(-2);  // [B, Hq, D, D]
    cov = (second / static_cast<double>(n) - outer).to(at::kFloat);
  }
  return score_from_statistics(in, mu, cov);
}

at::Tensor ExpectedAttentionPress::score_from_statistics(const LayerInputs& in, const at::Tensor& query_mean,
                                                         const at::Tensor& query_cov) const {
  const std::string press = name();
  const char* op = press.c_str();
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  const int64_t n = seq - params_.n_sink, heads = query_mean.size(1), group = heads / kv_heads;

  // R̄ = mean over the future positions of cos_t·I + sin_t·P (P: rotate_half as a matrix).
  const at::Tensor R =
      ops::average_rope_rotation(ops::rope_inv_freq(in, op), seq, params_.n_future_positions);  // [D, D]

  const at::Tensor mu = at::matmul(query_mean, R.t());                       // [B, Hq, D]
  const at::Tensor k = in.keys.narrow(2, params_.n_sink, n).to(at::kFloat);  // [B, Hkv, n, D]
  // Fold each group's query heads into a matmul with its KV head: [B, Hkv, n, G].
  at::Tensor z = at::matmul(k, mu.view({batch, kv_heads, group, d}).transpose(2, 3)) / std::sqrt(double(d));
  if (params_.use_covariance) {
    const at::Tensor cov = at::matmul(R, at::matmul(query_cov, R.t()));  // [B, Hq, D, D]
    // k_iᵀ Σ'_h k_i for every query head h of a group as one GEMM per chunk of keys: the group's
    // covariances side by side, [D, G * D], times the chunk's keys, then each D-wide block of the
    // product dotted with the key. Scratch is one chunk: [B, Hkv, rows, G * D].
    const at::Tensor side_by_side =
        cov.view({batch, kv_heads, group, d, d}).permute({0, 1, 3, 2, 4}).reshape({batch, kv_heads, d, group * d});
    at::Tensor quad = at::empty({batch, kv_heads, n, group}, z.options());
    const int64_t chunk = std::max<int64_t>(1, (int64_t{16} << 20) / std::max<int64_t>(1, batch * heads * d * 4));
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t rows = std::min(chunk, n - start);
      const at::Tensor kc = k.narrow(2, start, rows);  // [B, Hkv, rows, D]
      const at::Tensor products = at::matmul(kc, side_by_side).view({batch, kv_heads, rows, group, d});
      quad.narrow(2, start, rows).copy_(products.mul_(kc.unsqueeze(3)).sum(-1));
    }
    z = z + quad / static_cast<double>(d) / 2.0;
  }
  at::Tensor s = at::softmax(z, 2).mean(3);  // softmax over positions per query head, group mean -> [B, Hkv, n]
  if (params_.use_vnorm)
    s = (s + params_.epsilon) * at::linalg_vector_norm(in.values.narrow(2, params_.n_sink, n).to(at::kFloat), 2, {-1});
  if (params_.n_sink == 0) return s.contiguous();
  const double pad = s.max().item<double>() + 1.0;
  return at::cat({at::full({batch, kv_heads, params_.n_sink}, pad, s.options()), s}, 2).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"ExpectedAttentionPress", PressKind::kScorer,
                    "expected attention of future queries (query mean/covariance, averaged RoPE)",
                    pre_rope_query_inputs(), from_params<ExpectedAttentionPress>};
});

}  // namespace

}  // namespace kvpress
