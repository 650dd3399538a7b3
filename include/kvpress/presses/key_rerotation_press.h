#pragma once

#include <memory>

#include "kvpress/presses/base_press.h"

namespace kvpress {

// KeyRerotationPress (kvpress): selects with the inner scorer, keeps the positions in ascending
// order and rotates each kept key from its original position p to its new slot j (its rank):
// k' = k·cos(Δ·inv_freq) + rotate_half(k)·sin(Δ·inv_freq), Δ = j - p (angles in float32, the
// products in the cache dtype, as kvpress). The compressed cache then looks as if the kept tokens
// had been encoded at positions 0..n_kept-1, so the engine continues at position n_kept.
// kept_indices still hold the ORIGINAL positions. Needs inv_freq (or float32 cos/sin to derive it).
// The compression ratio is the inner press's.
class KeyRerotationPress : public ScorerWrapperPress {
 public:
  explicit KeyRerotationPress(std::shared_ptr<const ScorerPress> press)
      : ScorerWrapperPress(std::move(press), "KeyRerotationPress") {}

  std::string name() const override { return "KeyRerotationPress"; }
  KV compress(const LayerInputs& inputs) const override;
  bool rerotates_keys() const override { return true; }

  // Rotates kv.keys in place from their original positions kv.kept_indices (ascending per head) to
  // the slots 0..n_kept-1 (FinchPress shares it).
  static void rerotate_kept_keys(KV& kv,                       // keys [B, Hkv, n_kept, D], written
                                 const at::Tensor& inv_freq);  // [D / 2] float32
};

}  // namespace kvpress
