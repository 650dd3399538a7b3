#include "kvpress/presses/pyramidkv_press.h"

#include <ATen/ATen.h>

#include <cmath>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

// Python's round() of a float: to the nearest integer, halves to even (nearbyint under the
// default rounding mode).
int64_t python_round(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

}  // namespace

PyramidKVPress::PyramidKVPress(double compression_ratio, const Params& params)
    : PyramidKVPress(compression_ratio, params.window_size, params.kernel_size, params.beta) {}

PyramidKVPress::PyramidKVPress(double compression_ratio, int64_t window_size, int64_t kernel_size, int64_t beta)
    : SnapKVPress(compression_ratio, window_size, kernel_size), beta_(beta) {
  check_params("PyramidKVPress", Params{{window_size, kernel_size}, beta});
  TORCH_CHECK(beta >= 1, "PyramidKVPress: beta must be >= 1, got ", beta);
}

int64_t PyramidKVPress::layer_budget(int64_t seq_len, int64_t layer_idx, int64_t num_layers) const {
  constexpr const char* op = "PyramidKVPress";
  checks::check_positive(op, "num_layers", num_layers);
  TORCH_CHECK(layer_idx >= 0 && layer_idx < num_layers, op, ": layer_idx must be in [0, num_layers (", num_layers,
              ")), got ", layer_idx);
  checks::check_positive(op, "seq_len", seq_len);
  // kvpress (after KVCache-Factory): the layers' budgets average to S·(1 - ratio); the window
  // counts in the budget.
  const double q_len = static_cast<double>(seq_len), window = static_cast<double>(window_size());
  const double kept = q_len * (1.0 - compression_ratio());
  const double max_capacity = window + kept;
  double min_num = (max_capacity - window) / static_cast<double>(beta_);
  double max_num = (max_capacity - window) * 2 - min_num;
  if (max_num >= q_len - window) {
    max_num = q_len - window;
    min_num = (max_capacity - window) * 2 - max_num;
  }
  if (!(q_len >= max_num && max_num >= min_num && min_num >= window)) return std::max<int64_t>(1, python_round(kept));
  const double steps = num_layers > 1 ? (max_num - min_num) / static_cast<double>(num_layers - 1) : 0.0;
  return python_round(max_num - static_cast<double>(layer_idx) * steps);
}

at::Tensor PyramidKVPress::kept_positions(const LayerInputs& in) const {
  const std::string op = name() + ".compress";
  checks::check_kv(op.c_str(), in.keys, in.values);
  const int64_t seq = in.keys.size(2);
  if (compression_ratio() == 0.0) return budget::keep_all(in).kept_indices;
  const int64_t n = layer_budget(seq, in.layer_idx, in.num_layers);
  const at::Tensor scores = score(in);
  checks::check_finite_scores(op.c_str(), scores);
  return ops::topk_indices(scores, n);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"PyramidKVPress",
                    PressKind::kScorer,
                    "SnapKV scores, budgets shrinking linearly from the first layer to the last",
                    {window_attention_inputs().alternatives, {}, {"layer_idx", "num_layers"}},
                    from_params<PyramidKVPress>};
});

}  // namespace

}  // namespace kvpress
