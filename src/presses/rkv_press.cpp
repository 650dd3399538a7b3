// RKVPress: R-KV's importance-minus-redundancy score (docs/PRESS_NOTES.md, "RKVPress").
#include "kvpress/presses/rkv_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "checks.h"
#include "kvpress/ops.h"
#include "layer_slices.h"
#include "presses/registration.h"

namespace kvpress {

namespace {

constexpr const char* kOp = "RKVPress";
// Added to each key's norm before the cosine similarities, as the authors' cal_similarity.
constexpr double kNormEpsilon = 1e-8;
// Similarity entries per block of rows (float32 plus their int64 column indices: 12 bytes each).
constexpr int64_t kBlockEntries = int64_t{1} << 21;

}  // namespace

RKVPress::RKVPress(double compression_ratio, const Params& params) : ScorerPress(compression_ratio), params_(params) {
  check_params(kOp, params_);
}

at::Tensor RKVPress::importance(const LayerInputs& in, int64_t window) const {
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), past = in.keys.size(2) - window;
  const int64_t d = in.keys.size(3);
  const at::Tensor q = ops::window_queries(in, window, kOp).to(at::kFloat);  // [B, Hq, w, D]
  checks::check_gqa(kOp, q.size(1), kv_heads);
  const int64_t group = q.size(1) / kv_heads;
  const at::Tensor k = in.keys.narrow(2, 0, past).to(at::kFloat).unsqueeze(2);  // [B, Hkv, 1, n, D]
  // Logits [B, Hkv, g, w, n], max-pooled over the group's query heads before the softmax.
  const at::Tensor logits =
      at::matmul(q.view({batch, kv_heads, group, window, d}), k.transpose(3, 4)) / std::sqrt(static_cast<double>(d));
  const at::Tensor attention = at::softmax(std::get<0>(logits.max(2)), -1).mean(2);  // [B, Hkv, n]
  return at::max_pool1d(attention, {params_.kernel_size}, {1}, {params_.kernel_size / 2});
}

at::Tensor RKVPress::redundancy(const at::Tensor& keys) const {
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), seq = keys.size(2);
  const at::Tensor k = keys.to(at::kFloat);
  const at::Tensor unit = k / (k.norm(2, -1, /*keepdim=*/true) + kNormEpsilon);  // [B, Hkv, S, D]
  const auto percent_rank = static_cast<int64_t>(static_cast<double>(seq) * params_.retain_ratio);
  const std::string& direction = params_.retain_direction;
  TORCH_CHECK(percent_rank >= 1 || (direction != "last_percent" && direction != "first_percent"), kOp,
              ": retain_direction ", direction, " needs int(S * retain_ratio) >= 1, got S = ", seq,
              " and retain_ratio = ", params_.retain_ratio);
  const at::Tensor columns = at::arange(seq, keys.options().dtype(at::kLong));
  at::Tensor column_sums = at::zeros({batch, kv_heads, seq}, k.options());
  const int64_t block = std::max<int64_t>(1, kBlockEntries / std::max<int64_t>(1, batch * kv_heads * seq));
  for (int64_t row = 0; row < seq; row += block) {
    const int64_t rows = std::min(block, seq - row);
    at::Tensor similarity = at::matmul(unit.narrow(2, row, rows), unit.transpose(2, 3));  // [B, Hkv, rows, S]
    similarity.diagonal(row, 2, 3).zero_();
    // Each row's similar columns (> the threshold) by index, 0 where not similar, as the authors'.
    const at::Tensor similar = at::where(similarity > kSimilarityThreshold, columns, int64_t{0});
    at::Tensor retained;  // [B, Hkv, rows]
    if (direction == "last" || direction == "last_percent") {
      retained = similar.amax(-1);  // last_percent's topk(k)[..., 0] is the maximum too
    } else if (direction == "first") {
      retained = similar.amin(-1);  // 0 whenever one column is not similar: the diagonal never is
    } else {
      retained = std::get<0>(similar.kthvalue(percent_rank, -1));
    }
    similarity.scatter_(-1, retained.unsqueeze(-1), 0.0);
    column_sums += similarity.sum(2);
  }
  return at::softmax(column_sums / static_cast<double>(seq), -1);
}

at::Tensor RKVPress::score(const LayerInputs& in) const {
  checks::check_kv(kOp, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t window = clamped_window(in, params_.window_size);
  const int64_t past = seq - window;
  at::Tensor scores = at::zeros({batch, kv_heads, seq}, in.keys.options().dtype(at::kFloat));
  if (past == 0) return scores;  // every position is the window's: all kept alike
  const double lambda = params_.mix_lambda;
  const at::Tensor mixed = importance(in, window) * lambda - redundancy(in.keys).narrow(2, 0, past) * (1.0 - lambda);
  scores.narrow(2, 0, past).copy_(mixed);
  scores.narrow(2, past, window).copy_(std::get<0>(mixed.max(2, /*keepdim=*/true)).add(1.0).expand({-1, -1, window}));
  return scores;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"RKVPress", PressKind::kScorer,
                    "attention of the last queries (group max before the softmax) minus key redundancy (R-KV)",
                    window_query_inputs(), from_params<RKVPress>};
});

}  // namespace

}  // namespace kvpress
