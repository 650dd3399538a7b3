#include "kvpress/presses/key_rerotation_press.h"

#include <ATen/ATen.h>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

KV KeyRerotationPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "KeyRerotationPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio() == 0.0) return budget::keep_all(in);
  const int64_t seq = in.keys.size(2);
  const at::Tensor inv_freq = ops::rope_inv_freq(in, op);
  const at::Tensor scores = inner_scores(in, op);
  KV kv = ops::gather_kv(in.keys, in.values, ops::topk_indices(scores, ops::n_kept(seq, compression_ratio())));
  rerotate_kept_keys(kv, inv_freq);
  return kv;
}

void KeyRerotationPress::rerotate_kept_keys(KV& kv, const at::Tensor& inv_freq) {
  // Δ = new slot - old position, angles in float32; products in the cache dtype (as kvpress).
  // One (batch row, KV head) at a time, in place: the temporaries stay a head's size instead of
  // several float32 copies of all kept keys.
  const int64_t n = kv.kept_indices.size(2);
  const at::Tensor slot = at::arange(n, inv_freq.options());
  const auto dt = kv.keys.scalar_type();
  for (int64_t b = 0; b < kv.keys.size(0); ++b) {
    for (int64_t h = 0; h < kv.keys.size(1); ++h) {
      at::Tensor head = kv.keys[b][h];                                       // [n, D] view
      const at::Tensor delta = slot - kv.kept_indices[b][h].to(at::kFloat);  // [n]
      const at::Tensor freqs = delta.unsqueeze(-1) * inv_freq;               // [n, D/2]
      const at::Tensor emb = at::cat({freqs, freqs}, -1);                    // [n, D]
      head.copy_(head * emb.cos().to(dt) + ops::rotate_half(head) * emb.sin().to(dt));
    }
  }
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"KeyRerotationPress",
                    PressKind::kWrapper,
                    "inner scorer's selection, kept keys re-rotated to positions 0..n_kept-1",
                    {{{{"inv_freq"}}, {{"cos", "sin"}}}},
                    [](double r, ParamReader& p) { return std::make_unique<KeyRerotationPress>(inner_scorer(p, r)); }};
});

}  // namespace

}  // namespace kvpress
