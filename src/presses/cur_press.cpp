// CURPress (kvpress 0.5.5's CurDKV press). The arithmetic follows kvpress step by step in the cache
// dtype (squares summed over channels, window and sequence normalisations), so that the scores
// are kvpress's; docs/PRESS_NOTES.md lists the details.
#include "kvpress/presses/cur_press.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "checks.h"

namespace kvpress {
namespace {

// ‖x_i‖² per position: [B, H, S] in x's dtype, one head at a time (no [B, H, S, D] temporary).
at::Tensor squared_norms(const at::Tensor& x) {  // [B, H, S, D]
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  for (int64_t h = 0; h < x.size(1); ++h) out.select(1, h).copy_(x.select(1, h).square().sum(-1));
  return out;
}

// Each window of w consecutive positions divided by its sum (the last window zero-padded).
at::Tensor normalise_windows(const at::Tensor& s, int64_t w) {  // [B, H, S]
  const int64_t seq = s.size(2), pad = (w - seq % w) % w;
  const at::Tensor blocks = at::constant_pad_nd(s, {0, pad}).view({s.size(0), s.size(1), -1, w});
  return (blocks / blocks.sum(-1, /*keepdim=*/true)).view({s.size(0), s.size(1), -1}).narrow(2, 0, seq);
}

}  // namespace

CURPress::CURPress(double compression_ratio, int64_t num_sinks, LeverageType leverage_type, bool use_random_leverage,
                   bool use_local_approximation, int64_t local_window_size, std::optional<int64_t> seed)
    : ScorerPress(compression_ratio),
      num_sinks_(num_sinks),
      leverage_type_(leverage_type),
      use_random_leverage_(use_random_leverage),
      use_local_approximation_(use_local_approximation),
      local_window_size_(local_window_size),
      seed_(seed) {
  checks::check_non_negative("CURPress", "num_sinks", num_sinks);
  checks::check_positive("CURPress", "local_window_size", local_window_size);
}

at::Tensor CURPress::score(const LayerInputs& in) const {
  constexpr const char* op = "CURPress";
  checks::check_kv(op, in.keys, in.values);
  at::Tensor keys = in.keys, values = in.values;
  if (use_random_leverage_) {
    // G = randn(D, 20) / sqrt(20) in the cache dtype, drawn on the CPU as kvpress does for a CPU
    // cache; both K and V are projected by the same G.
    const auto options = at::TensorOptions().dtype(keys.scalar_type());
    at::Tensor g = seed_ ? at::randn({keys.size(3), kRandomDimension},
                                     at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(*seed_)), options)
                         : at::randn({keys.size(3), kRandomDimension}, options);
    g = (g / std::sqrt(static_cast<double>(kRandomDimension))).to(keys.device());
    keys = at::matmul(keys, g);
    values = at::matmul(values, g);
  }
  at::Tensor k2 = squared_norms(keys), v2 = squared_norms(values);
  if (use_local_approximation_) {
    k2 = normalise_windows(k2, local_window_size_);
    v2 = normalise_windows(v2, local_window_size_);
  }
  at::Tensor scores;
  switch (leverage_type_) {
    case LeverageType::kKey: scores = k2; break;
    case LeverageType::kValue: scores = v2; break;
    case LeverageType::kKvAvg: scores = (k2 + v2) / 2; break;
    case LeverageType::kKvProduct: scores = k2 * v2; break;
  }
  scores = scores / scores.sum(-1, /*keepdim=*/true);
  scores.narrow(2, 0, std::min(num_sinks_, scores.size(2))).fill_(1.0);
  return scores.to(at::kFloat).contiguous();
}

}  // namespace kvpress
