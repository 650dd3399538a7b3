#include "kvpress/presses/simlayerkv_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

SimLayerKVPress::SimLayerKVPress(const Params& params)
    : SimLayerKVPress(params.lazy_threshold, params.n_last, params.n_recent, params.n_initial) {}

SimLayerKVPress::SimLayerKVPress(double lazy_threshold, int64_t n_last, int64_t n_recent, int64_t n_initial)
    : lazy_threshold_(lazy_threshold), n_last_(n_last), n_recent_(n_recent), n_initial_(n_initial) {
  check_params("SimLayerKVPress", Params{lazy_threshold, n_last, n_recent, n_initial});
  constexpr const char* op = "SimLayerKVPress";
  TORCH_CHECK(n_recent > n_last, op, ": n_recent must be > n_last = ", n_last,
              " (a lazy layer keeps its last n_recent - n_last tokens), got ", n_recent);
}

std::optional<double> SimLayerKVPress::lazy_score(const LayerInputs& in) const {
  constexpr const char* op = "SimLayerKVPress.compress";
  checks::check_kv(op, in.keys, in.values);
  const int64_t seq = in.keys.size(2);
  if (lazy_threshold_ == 1.0 || seq <= n_initial_ + n_recent_ + n_last_) return std::nullopt;
  // The last n_last queries' attention over the keys before them, averaged over the batch, the
  // query heads and those queries: [S - n_last]. seq > n_initial + n_recent + n_last, so the two
  // ends do not overlap.
  // (Over every query head: on a rank's share, from every rank's sums.)
  const at::Tensor local = ops::window_attention_mean(in, n_last_, op);  // [B, Hq, S - n_last]
  const at::Tensor attention = in.head_exchange
                                   ? head_exchange::sum_over_ranks(in, local.sum(at::IntArrayRef{0, 1})) /
                                         static_cast<double>(local.size(0) * local.size(1) * head_exchange::ranks(in))
                                   : local.mean(at::IntArrayRef{0, 1});
  const int64_t observed = attention.size(0);
  const at::Tensor share =
      attention.narrow(0, 0, n_initial_).sum() + attention.narrow(0, observed - n_recent_, n_recent_).sum();
  return share.item<double>();
}

bool SimLayerKVPress::is_lazy(const LayerInputs& in) const {
  const std::optional<double> score = lazy_score(in);
  return score && *score > lazy_threshold_;
}

at::Tensor SimLayerKVPress::lazy_positions(const LayerInputs& in) const {
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t recent = n_recent_ - n_last_;
  const at::TensorOptions opts = in.keys.options().dtype(at::kLong);
  const at::Tensor kept = at::cat({at::arange(n_initial_, opts), at::arange(seq - recent, seq, opts)});
  return kept.view({1, 1, -1}).expand({batch, kv_heads, kept.size(0)}).contiguous();
}

at::Tensor SimLayerKVPress::kept_positions(const LayerInputs& in) const {
  return is_lazy(in) ? lazy_positions(in) : budget::keep_all(in).kept_indices;
}

KV SimLayerKVPress::compress(const LayerInputs& in) const {
  if (!is_lazy(in)) return budget::keep_all(in);  // the cache untouched, as kvpress returns it
  return ops::gather_kv(in.keys, in.values, lazy_positions(in));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "SimLayerKVPress",
      PressKind::kLayer,
      "SimLayerKV: a layer whose last queries attend mostly to its first and last tokens keeps only those",
      {window_attention_inputs().alternatives,
       {},
       {},
       "read only where a layer is judged (lazy_threshold < 1, S > n_initial + n_recent + n_last)"},
      from_params<SimLayerKVPress>,
      "each layer keeps every token or only its initial and recent ones, by lazy_threshold"};
});

}  // namespace

}  // namespace kvpress
