// CTRPress: stage II of CTR-Press (github.com/xiyuanyang-code/CTRPress; docs/PRESS_NOTES.md
// "QSMPress / CTRPress"). QSMPress's selection with an entropy-adaptive budget, then the rescue:
// the evicted tokens the queries would attend to most are merged back into their nearest kept
// neighbour's value.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "kvpress/presses/qsm_press.h"

namespace kvpress {

// Which tokens the budget's score entropy E is computed over.
enum class CTREntropy {
  // The non-forced tokens (default): p = softmax of their head-mean scores, E normalised by
  // ln(#non-forced); the budget never drops below #forced.
  kNonForced,
  // The reference's arithmetic: every token, forced ones at float max. With two or more KV heads
  // the head mean overflows to inf, E is NaN and the clip makes it 1, so n' = round(n * (1 - beta))
  // (the paper's 0.80x KV memory); with one KV head E = ln(#forced). Normalised by ln S; the
  // budget may drop below #forced (ties among forced keeps go to the lower position).
  kReference,
};

struct CTROptions {
  double rescue_ratio = 0.1;                // rescue max(1, int(rescue_ratio * #evicted)) tokens per head; 0: none
  std::string rescue_scoring = "key_miss";  // the reference's only rescue score
  bool use_layer_adaptive = true;
  double entropy_beta = 0.2;  // n' = round(n * (1 + beta * (1 - 2 * E_normalised)))
  CTREntropy entropy = CTREntropy::kNonForced;

  // CTRPress's parameters after QSMOptions's (the reference's names).
  template <typename Self, typename Visit>
  static void for_each_field(Self& self, Visit&& visit) {
    visit(ParamSpec{"rescue_ratio", "fraction of the evicted tokens rescued per head (0: none)"}, self.rescue_ratio);
    visit(ParamSpec{"rescue_scoring", "rescue score (only key_miss)"}.one_of({"key_miss"}), self.rescue_scoring);
    visit(ParamSpec{"use_layer_adaptive", "entropy-adaptive budget"}, self.use_layer_adaptive);
    visit(ParamSpec{"entropy_beta", "beta: n' = round(n * (1 + beta * (1 - 2 E/E_max)))"}, self.entropy_beta);
    visit(ParamSpec{"entropy",
                    "non_forced (E over the non-forced tokens) or reference (the reference's overflowing arithmetic)"}
              .one_of({"non_forced", "reference"}),
          self.entropy);
  }
};

class CTRPress : public QSMPress {
 public:
  explicit CTRPress(double compression_ratio = 0.0, QSMOptions qsm = {}, CTROptions ctr = {},
                    TokenTextFn token_text = nullptr);

  std::string name() const override { return "CTRPress"; }
  // The adaptive budget's entropy reads every head's scores (gathered on a rank's share).
  HeadSpan head_span() const override { return ctr_.use_layer_adaptive ? HeadSpan::kExchanged : HeadSpan::kPerHead; }
  const CTROptions& ctr_options() const { return ctr_; }

  // Tokens kept per head: the entropy-adaptive budget from QSMPress's kept_count (unchanged
  // without use_layer_adaptive). `st` holds every head of the layer (a rank's share: its scores
  // gathered from every rank first).
  int64_t adaptive_kept_count(const QSMScores& st) const;

  KV compress(const LayerInputs& inputs) const override;

 private:
  CTROptions ctr_;
};

// The normalised entropy of the head-mean scores, in [0, 1], as CTREntropy describes; the budget
// is then round(n * (1 + beta * (1 - 2 * e))) (round half to even, as Python's round). Returns a
// negative value when there is nothing to normalise (fewer than two tokens in the distribution):
// the budget then stays n.
double ctr_normalized_entropy(const at::Tensor& scores,  // [B, Hkv, S] stage-I scores, forced = float max
                              const at::Tensor& forced,  // [S] bool
                              CTREntropy mode);

// The rescue score rho of every evicted token, per KV head: the largest weight a query of that
// head's group, at any of the S positions, gives it in a non-causal softmax over that head's
// evicted keys only (q . k / sqrt(D)). Kept positions get -1.
at::Tensor ctr_rescue_scores(const at::Tensor& queries,        // [B, Hq, S, D] post-RoPE, every position
                             const at::Tensor& keys,           // [B, Hkv, S, D]
                             const at::Tensor& kept_indices);  // [B, Hkv, n] -> [B, Hkv, S] float32

}  // namespace kvpress
