#include "kvpress/presses/adakv_press.h"

#include <ATen/ATen.h>

#include <cmath>

#include "budget_helpers.h"
#include "checks.h"
#include "kvpress/ops.h"

namespace kvpress {

AdaKVPress::AdaKVPress(std::shared_ptr<const ScorerPress> press, double alpha_safeguard)
    : press_(std::move(press)), alpha_safeguard_(alpha_safeguard) {
  TORCH_CHECK(press_ != nullptr, "AdaKVPress: press must be a ScorerPress, got nullptr");
  TORCH_CHECK(std::isfinite(alpha_safeguard) && alpha_safeguard >= 0.0 && alpha_safeguard <= 1.0,
              "AdaKVPress: alpha_safeguard must be in [0, 1], got ", alpha_safeguard);
}

KV AdaKVPress::compress(const LayerInputs&) const {
  TORCH_CHECK(false,
              "AdaKVPress.compress: AdaKVPress keeps a different number of tokens per KV head, which a "
              "[B, Hkv, n_kept, D] cache cannot hold; use compress_ragged() (head_ragged() is true)");
}

at::Tensor AdaKVPress::keep_mask(const LayerInputs& in) const {
  constexpr const char* op = "AdaKVPress.compress_ragged";
  checks::check_kv(op, in.keys, in.values);
  const double ratio = compression_ratio();
  if (ratio == 0.0) return budget::keep_everything(in);
  const int64_t kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t n_kept = ops::n_kept(seq, ratio);
  const at::Tensor scores = budget::force_top_per_head(budget::inner_scores(*press_, in, op),
                                                       budget::safeguard_count(n_kept, alpha_safeguard_));
  // kvpress masks the Hkv·(S - n_kept) lowest scores of each batch row; we keep the rest.
  return ops::topk_mask_across_heads(scores, kv_heads * n_kept);
}

RaggedKV AdaKVPress::compress_ragged(const LayerInputs& in) const {
  return ops::gather_ragged(in.keys, in.values, keep_mask(in));
}

}  // namespace kvpress
