#pragma once

#include <cstdint>
#include <optional>

#include "kvpress/presses/base_press.h"

namespace kvpress {

// FINCH (TACL 2024, kvpress 0.5.5's FinchPress): SnapKV-style scores where the observation window is
// the question itself. The prefill must end with the question: LayerInputs::question_length > 0
// trailing positions (kvpress finds them from a delimiter token it strips from the embeddings; an
// engine knows where its question starts). Each window row i (at position S - w + i) is weighted by
// S - w + i when normalize_scores (the number of keys it attends before itself, undoing softmax's
// dilution), the rows are averaged, then the GQA groups; the window gets max + 1 so it is kept.
// The n_kept best are kept over the whole layer, or with chunk_length the best
// int(chunk * (1 - ratio)) of every chunk_length positions (kvpress requires
// chunk_length > w / (1 - ratio)). With rerotate_keys (the default) the kept keys are re-rotated to
// positions 0..n_kept-1 as KeyRerotationPress does, and the engine continues at n_kept.
// Attention comes from inputs.attentions (its last w rows), else the window's queries (given or
// recomputed from hidden states), softmax in float32.
// Not a ScorerPress, as in kvpress: wrappers do not take it.
class FinchPress : public BasePress {
 public:
  static constexpr bool kDefaultNormalizeScores = true;
  static constexpr bool kDefaultRerotateKeys = true;

  // Raises unless 0 <= compression_ratio < 1 and chunk_length (when set) > 0.
  explicit FinchPress(double compression_ratio = 0.0, std::optional<int64_t> chunk_length = std::nullopt,
                      bool normalize_scores = kDefaultNormalizeScores, bool rerotate_keys = kDefaultRerotateKeys);

  std::string name() const override { return "FinchPress"; }
  double compression_ratio() const override { return compression_ratio_; }
  bool rerotates_keys() const override { return rerotate_keys_; }
  bool observes_question() const override { return true; }
  const std::optional<int64_t>& chunk_length() const { return chunk_length_; }
  bool normalize_scores() const { return normalize_scores_; }

  // [B, Hkv, S] float32, higher = keep; the question's positions get max + 1.
  at::Tensor score(const LayerInputs& inputs) const;
  KV compress(const LayerInputs& inputs) const override;
  // The positions compress() keeps, [B, Hkv, n_kept] int64 ascending, without rerotate_keys;
  // undefined with it (the kept keys change).
  at::Tensor kept_positions(const LayerInputs& inputs) const override;

 private:
  double compression_ratio_;
  std::optional<int64_t> chunk_length_;
  bool normalize_scores_;
  bool rerotate_keys_;

  at::Tensor select(const LayerInputs& inputs) const;  // -> [B, Hkv, n_kept] int64 ascending
};

}  // namespace kvpress
