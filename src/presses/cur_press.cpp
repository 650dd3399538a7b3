// CURPress (kvpress 0.5.5's CurDKV press). The arithmetic follows kvpress step by step in the cache
// dtype (squares summed over channels, window and sequence normalisations), so that the scores
// are kvpress's; docs/PRESS_NOTES.md lists the details.
#include "kvpress/presses/cur_press.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "checks.h"
#include "presses/registration.h"

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

CURPress::CURPress(double compression_ratio, const Params& params) : ScorerPress(compression_ratio), params_(params) {
  check_params("CURPress", params_);
}

at::Tensor CURPress::score(const LayerInputs& in) const {
  constexpr const char* op = "CURPress";
  checks::check_kv(op, in.keys, in.values);
  at::Tensor keys = in.keys, values = in.values;
  if (params_.use_random_leverage) {
    // G = randn(D, 20) / sqrt(20) in the cache dtype, drawn on the CPU as kvpress does for a CPU
    // cache; both K and V are projected by the same G.
    const auto options = at::TensorOptions().dtype(keys.scalar_type());
    at::Tensor g =
        params_.seed
            ? at::randn({keys.size(3), kRandomDimension},
                        at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(*params_.seed)), options)
            : at::randn({keys.size(3), kRandomDimension}, options);
    g = (g / std::sqrt(static_cast<double>(kRandomDimension))).to(keys.device());
    keys = at::matmul(keys, g);
    values = at::matmul(values, g);
  }
  at::Tensor k2 = squared_norms(keys), v2 = squared_norms(values);
  if (params_.use_local_approximation) {
    k2 = normalise_windows(k2, params_.local_window_size);
    v2 = normalise_windows(v2, params_.local_window_size);
  }
  at::Tensor scores;
  switch (params_.leverage_type) {
    case LeverageType::kKey: scores = k2; break;
    case LeverageType::kValue: scores = v2; break;
    case LeverageType::kKvAvg: scores = (k2 + v2) / 2; break;
    case LeverageType::kKvProduct: scores = k2 * v2; break;
  }
  scores = scores / scores.sum(-1, /*keepdim=*/true);
  scores.narrow(2, 0, std::min(params_.num_sinks, scores.size(2))).fill_(1.0);
  return scores.to(at::kFloat).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"CURPress",
                    PressKind::kScorer,
                    "CurDKV: key and value leverage (squared norms), window-normalised, combined",
                    {},
                    from_params<CURPress>};
});

}  // namespace

}  // namespace kvpress
