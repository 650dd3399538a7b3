#pragma once

#include <memory>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// MergingPress (kvpress 0.5.5; after Token Merging, arXiv 2210.09461, and D2O, arXiv 2406.13035):
// the inner scorer keeps its n_kept best tokens per head, as a ScorerPress does, but each evicted
// token's value is first folded into the kept token whose key is most cosine-similar (float32;
// norms clamped at 1e-6; ties: the lower kept position). A merge needs that similarity >=
// similarity_threshold and, with merge_fraction < 1, to be among the top merge_fraction of the
// head's eligible similarities (the 1 - merge_fraction quantile, linear interpolation, ineligible
// ones counted as -inf, as kvpress). Evicted token e with similarity s into target t weighs
// w = max(s, 0) · |v_e| / (|v_e| + |v_t| + 1e-6); a target that received any weight becomes
// (v_t + Σ w v_e) / (1 + Σ w), in float32, rounded to the cache dtype. Keys are kept unchanged
// (RoPE-safe). kept_indices ascending; the values differ from the cache's, so kept_positions() is
// undefined. The compression ratio is the inner press's.
class MergingPress : public ScorerWrapperPress {
 public:
  static constexpr double kDefaultSimilarityThreshold = 0.0;
  static constexpr double kDefaultMergeFraction = 1.0;
  // The evicted values are gathered in blocks of evicted rows of at most this many float32 entries
  // (4 MiB). The nearest kept keys come one head at a time from ops::max_similarity, which never
  // holds the [B, Hkv, n_evicted, n_kept] similarities (2 GiB at S = 16384, Hkv = 8, ratio 0.5).
  static constexpr int64_t kEvictedBlockElements = int64_t{1} << 20;

  // Its parameters besides the inner press.
  struct Params {
    double similarity_threshold = kDefaultSimilarityThreshold;
    double merge_fraction = kDefaultMergeFraction;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"similarity_threshold", "least cosine similarity for a merge"}.fraction(),
            self.similarity_threshold);
      visit(ParamSpec{"merge_fraction", "fraction of the evicted tokens merged (the most similar)"},
            self.merge_fraction);
    }
  };

  // Raises unless press is non-null, 0 <= similarity_threshold <= 1 and 0 < merge_fraction <= 1.
  explicit MergingPress(std::shared_ptr<const ScorerPress> press,
                        double similarity_threshold = kDefaultSimilarityThreshold,
                        double merge_fraction = kDefaultMergeFraction);
  // The registry's form: its Params (kvpress/press_params.h).
  MergingPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : MergingPress(std::move(press), params.similarity_threshold, params.merge_fraction) {}

  std::string name() const override { return "MergingPress"; }
  KV compress(const LayerInputs& inputs) const override;

  double similarity_threshold() const { return similarity_threshold_; }
  double merge_fraction() const { return merge_fraction_; }

 private:
  double similarity_threshold_;
  double merge_fraction_;
};

}  // namespace kvpress
