#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvpress/presses/base_press.h"
#include "kvpress/types.h"

namespace kvpress {

// How a blended press turns scores into kept tokens.
enum class TokenSelection {
  kPerHead,     // the n_kept best positions of every KV head (kvpress; compress() works)
  kAcrossHeads  // the Hkv * n_kept best (head, position) pairs of each batch row (Compactor paper):
                // heads keep different numbers of tokens, so use compress_ragged() / keep_mask()
};

struct ScoreBlendOptions {
  int64_t sink_size_start = 0;  // first positions always kept
  int64_t sink_size_end = 0;    // last positions always kept
  bool normalize = true;        // z-score each scorer's scores before weighting (see below)
  TokenSelection selection = TokenSelection::kPerHead;
};

// Blends any ScorerPresses: score = sum_i w_i * z(s_i), z the global z-score (one mean and one
// std over the whole [B, Hkv, S] tensor, as kvpress's Compactor scorers normalise). With sinks,
// the scorers see only the inner positions [sink_size_start, S - sink_size_end) (keys, values,
// hidden_states, cos/sin, and the rows/columns of queries and attentions that fall there;
// attention weights are not renormalised), and the sink positions get the maximum of the blended
// scores (kvpress's CompactorPress rule): the best inner position ties with them, so they are all
// kept once n_kept exceeds their count (ties go to the lower position). When every
// position is a sink, every score is 1. `normalize = false` sums the raw scores, for scorers that
// already return z-scores (CompactorPress's do; z is idempotent up to rounding).
class ScoreBlendPress : public ScorerPress {
 public:
  ScoreBlendPress(double compression_ratio, std::vector<std::shared_ptr<const ScorerPress>> scorers,
                  std::vector<double> weights, ScoreBlendOptions options = {});

  std::string name() const override { return "ScoreBlendPress"; }
  // Exchanged (z-scores over every head, the sinks' maximum, across-heads budgets), or wider if a
  // scorer's span is.
  HeadSpan head_span() const override;

  at::Tensor score(const LayerInputs& inputs) const override;

  // Per-head selection as every ScorerPress. Raises for TokenSelection::kAcrossHeads, whose heads
  // keep different numbers of tokens: use compress_ragged() there.
  KV compress(const LayerInputs& inputs) const override;

  // [B, Hkv, S] bool: the kept positions under options().selection (compress_ragged() gathers them).
  at::Tensor keep_mask(const LayerInputs& inputs) const override;
  bool head_ragged() const override { return options_.selection == TokenSelection::kAcrossHeads; }

  const std::vector<std::shared_ptr<const ScorerPress>>& scorers() const { return scorers_; }
  const ScoreBlendOptions& options() const { return options_; }

  // The weights applied at the next score() (CompactorPress derives one from the ratio).
  virtual std::vector<double> weights() const { return weights_; }

 private:
  std::vector<std::shared_ptr<const ScorerPress>> scorers_;
  std::vector<double> weights_;
  ScoreBlendOptions options_;
};

}  // namespace kvpress
