#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>

#include "kvpress/press_params.h"
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
class AdaKVPress : public HeadRaggedWrapperPress {
 public:
  static constexpr double kDefaultAlphaSafeguard = 0.20;

  // Its parameters besides the inner press.
  struct Params {
    double alpha_safeguard = kDefaultAlphaSafeguard;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"alpha_safeguard", "fraction of n_kept every head keeps at least"}.fraction(),
            self.alpha_safeguard);
    }
  };

  // Raises unless press is non-null and 0 <= alpha_safeguard <= 1 (kvpress's range).
  explicit AdaKVPress(std::shared_ptr<const ScorerPress> press, double alpha_safeguard = kDefaultAlphaSafeguard);
  // The registry's form: its Params (kvpress/press_params.h).
  AdaKVPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : AdaKVPress(std::move(press), params.alpha_safeguard) {}

  std::string name() const override { return "AdaKVPress"; }
  // Budgets across every head: on a rank's share, the inner scores of every head are exchanged.
  HeadSpan head_span() const override { return wider_span(HeadSpan::kExchanged, press()->head_span()); }

  // [B, Hkv, S] bool: the kept positions (the complement of kvpress's masked_key_indices);
  // compress_ragged() gathers them, compress() raises.
  at::Tensor keep_mask(const LayerInputs& inputs) const override;

  double alpha_safeguard() const { return alpha_safeguard_; }

 private:
  double alpha_safeguard_;
};

}  // namespace kvpress
