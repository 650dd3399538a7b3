#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

#include "kvpress/presses/base_press.h"

namespace kvpress {

// AdaKVPress (kvpress; arXiv 2407.11550): head-adaptive budgets. The inner scorer's scores get a
// safeguard (the top n_safe = int(n_kept · alpha_safeguard) positions of every head, at least 1
// when alpha_safeguard > 0, are forced to float max), then the Hkv · n_kept best (head, position)
// pairs of each batch row are kept, n_kept = max(1, int(S · (1 - ratio))): the layer keeps as many
// tokens as a per-head press, but heads keep different numbers. kvpress masks the dropped keys
// (attention_patch); here the heads are stored head-ragged, so compress() raises and
// compress_ragged() returns the per-head kept tokens. Ties go to the lower head, then the lower
// position. The compression ratio is the inner press's.
class AdaKVPress : public BasePress {
 public:
  // Raises unless press is non-null and 0 <= alpha_safeguard <= 1 (kvpress's range).
  explicit AdaKVPress(std::shared_ptr<const ScorerPress> press, double alpha_safeguard = 0.20);

  std::string name() const override { return "AdaKVPress"; }
  double compression_ratio() const override { return press_->compression_ratio(); }

  bool head_ragged() const override { return true; }
  // Raises: heads keep different numbers of tokens; use compress_ragged().
  KV compress(const LayerInputs& inputs) const override;
  RaggedKV compress_ragged(const LayerInputs& inputs) const override;

  // [B, Hkv, S] bool: the kept positions (the complement of kvpress's masked_key_indices).
  at::Tensor keep_mask(const LayerInputs& inputs) const;

  const std::shared_ptr<const ScorerPress>& press() const { return press_; }
  double alpha_safeguard() const { return alpha_safeguard_; }

 private:
  std::shared_ptr<const ScorerPress> press_;
  double alpha_safeguard_;
};

}  // namespace kvpress
