#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// DefensiveKV (Feng et al., "Taming the Fragility of KV Cache Eviction in LLM Inference",
// arXiv 2510.13334; the authors' EfficientDefensiveKVPress in github.com/FFY0/DefensiveKV; not in
// kvpress 0.5.5). SnapKV's window attention aggregated defensively, CriticalKV's value norms and
// stage 1, AdaKV's selection across heads. Over the first S - w positions (w = window_size):
//   1. p: the last w queries' causal softmax over all S keys (float32), per query head; the
//      window bias b is its mass on the w positions just before the window, averaged over the
//      batch, every query head and window row (the authors' code slices the window's columns off
//      first, then sums the last w columns left: we follow the code, not the name);
//   2. each row's weights over the S - w positions are avg-pooled (kernel_size, zero padded,
//      padding counted) and rescaled to the row's unpooled mass;
//   3. defensive aggregation: the maximum over the group's query heads and the window rows (not
//      the mean), clamped below at its mean over the positions;
//   4. times the token's value norm share: N_j / sum over the layer's KV heads of N_j, N the L1
//      norm of v W_o averaged over the group (CriticalKVPress::output_projected_value_norms);
//   5. stage 1: per head, the positions whose group- and row-mean attention (normalised to sum 1)
//      reaches 0.9 - b first, by descending attention (the one reaching it excluded), at most
//      int((S - w)(1 - ratio) - w) of them (the authors' clamp, counted on the S - w positions; a
//      negative clamp leaves all but that many, as their slice does) are raised to the layer's
//      maximum score;
//   6. the window gets the maximum too; the layer keeps the int(S (1 - ratio) Hkv) best (head,
//      position) pairs of each batch row (ties: the lower head, then the lower position), so heads
//      keep different numbers of tokens (head_ragged(): compress_ragged()).
// The window bias and the maxima span the batch, as the authors' code does. Where the authors'
// code errs: with attention weights given it never sets the window bias (a NameError); here it is
// computed from them too. Their weights are in the model dtype; here float32.
class DefensiveKVPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultWindowSize = 32;
  static constexpr int64_t kDefaultKernelSize = 5;
  static constexpr double kAttentionMass = 0.9;  // stage 1's target, before the window bias

  struct Params {
    int64_t window_size = kDefaultWindowSize;
    int64_t kernel_size = kDefaultKernelSize;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"window_size", "trailing queries observed (always kept); must be below the sequence length"}
                .positive(),
            self.window_size);
      visit(ParamSpec{"kernel_size", "odd width of the average pooling"}.positive_odd(), self.kernel_size);
    }
  };

  // Raises c10::Error for a ratio outside [0, 1) or a parameter outside its declared range.
  DefensiveKVPress(double compression_ratio, const Params& params);
  explicit DefensiveKVPress(double compression_ratio = 0.0, int64_t window_size = kDefaultWindowSize,
                            int64_t kernel_size = kDefaultKernelSize)
      : DefensiveKVPress(compression_ratio, Params{window_size, kernel_size}) {}

  std::string name() const override { return "DefensiveKVPress"; }
  const Params& params() const { return params_; }
  bool head_ragged() const override { return true; }
  // The window bias, the value-norm shares, the maximum and the selection span the layer's heads.
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }

  // Steps 1-6's scores before the selection: [B, Hkv, S] float32 (needs o_proj).
  at::Tensor score(const LayerInputs& inputs) const override;
  // [B, Hkv, S] bool: the kept (head, position) pairs; compress() raises (heads keep different counts).
  at::Tensor keep_mask(const LayerInputs& inputs) const override;
  KV compress(const LayerInputs& inputs) const override;

 private:
  Params params_;
};

}  // namespace kvpress
