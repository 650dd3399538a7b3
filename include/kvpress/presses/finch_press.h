#pragma once

#include <cstdint>
#include <optional>

#include "kvpress/press_params.h"
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

  struct Params {
    std::optional<int64_t> chunk_length;
    bool normalize_scores = kDefaultNormalizeScores;
    bool rerotate_keys = kDefaultRerotateKeys;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"chunk_length", "select the best of every chunk_length positions; None = whole layer"}.positive(),
            self.chunk_length);
      visit(ParamSpec{"normalize_scores", "weigh each question row's attention by its position"},
            self.normalize_scores);
      visit(ParamSpec{"rerotate_keys", "re-rotate the kept keys to positions 0..n_kept-1"}, self.rerotate_keys);
    }
  };

  // Raises unless 0 <= compression_ratio < 1 and the parameters are in their declared ranges.
  FinchPress(double compression_ratio, const Params& params);
  explicit FinchPress(double compression_ratio = 0.0, std::optional<int64_t> chunk_length = std::nullopt,
                      bool normalize_scores = kDefaultNormalizeScores, bool rerotate_keys = kDefaultRerotateKeys)
      : FinchPress(compression_ratio, Params{chunk_length, normalize_scores, rerotate_keys}) {}

  std::string name() const override { return "FinchPress"; }
  double compression_ratio() const override { return compression_ratio_; }
  bool rerotates_keys() const override { return params_.rerotate_keys; }
  bool observes_question() const override { return true; }
  const std::optional<int64_t>& chunk_length() const { return params_.chunk_length; }
  bool normalize_scores() const { return params_.normalize_scores; }

  // [B, Hkv, S] float32, higher = keep; the question's positions get max + 1.
  at::Tensor score(const LayerInputs& inputs) const;
  KV compress(const LayerInputs& inputs) const override;
  // The positions compress() keeps, [B, Hkv, n_kept] int64 ascending, without rerotate_keys;
  // undefined with it (the kept keys change).
  at::Tensor kept_positions(const LayerInputs& inputs) const override;

 private:
  double compression_ratio_;
  Params params_;

  at::Tensor select(const LayerInputs& inputs) const;  // -> [B, Hkv, n_kept] int64 ascending
};

}  // namespace kvpress
