#pragma once

#include <cstdint>
#include <optional>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// SimLayerKV (arXiv 2410.13846, kvpress 0.5.5's SimLayerKVPress): a layer is "lazy" when its last
// n_last queries put more than lazy_threshold of their attention (averaged over the batch, query
// heads and those queries) on the first n_initial and the last n_recent keys before them; a lazy
// layer keeps its first n_initial and last n_recent - n_last tokens (kvpress's slice
// keys[-n_recent + n_last:]), any other layer every token. lazy_threshold = 1 (the default) or
// S <= n_initial + n_recent + n_last keeps every token. There is no compression ratio: the kept
// fraction follows from each layer's decision (kvpress reports its mean after a forward pass; a
// runner reads it from the cache). The attention comes from the same sources as SnapKVPress's
// window (given attentions, queries, or queries recomputed from hidden states), in float32
// (kvpress rounds it to the cache dtype before averaging).
// Unlike kvpress, n_recent <= n_last is refused: kvpress's slice then starts at or before the
// first token and the lazy layer's cache holds the initial tokens twice.
class SimLayerKVPress : public BasePress {
 public:
  static constexpr double kDefaultLazyThreshold = 1.0;
  static constexpr int64_t kDefaultNLast = 1;
  static constexpr int64_t kDefaultNRecent = 1024;
  static constexpr int64_t kDefaultNInitial = 4;

  struct Params {
    double lazy_threshold = kDefaultLazyThreshold;
    int64_t n_last = kDefaultNLast;
    int64_t n_recent = kDefaultNRecent;
    int64_t n_initial = kDefaultNInitial;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"lazy_threshold", "a layer is lazy above this attention share (1: never)"}.fraction(),
            self.lazy_threshold);
      visit(ParamSpec{"n_last", "last queries whose attention decides"}.positive(), self.n_last);
      visit(ParamSpec{"n_recent", "recent tokens a lazy layer keeps (their last n_recent - n_last)"}, self.n_recent);
      visit(ParamSpec{"n_initial", "initial (sink) tokens a lazy layer keeps"}.non_negative(), self.n_initial);
    }
  };

  // Raises as the constructor below.
  explicit SimLayerKVPress(const Params& params);
  // Raises unless 0 <= lazy_threshold <= 1, n_last >= 1, n_recent > n_last and n_initial >= 0.
  explicit SimLayerKVPress(double lazy_threshold = kDefaultLazyThreshold, int64_t n_last = kDefaultNLast,
                           int64_t n_recent = kDefaultNRecent, int64_t n_initial = kDefaultNInitial);

  std::string name() const override { return "SimLayerKVPress"; }
  // The lazy-layer test averages every query head's attention (sums exchanged on a rank's share).
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }
  double compression_ratio() const override { return 0.0; }  // none: decided per layer
  double lazy_threshold() const { return lazy_threshold_; }
  int64_t n_last() const { return n_last_; }
  int64_t n_recent() const { return n_recent_; }
  int64_t n_initial() const { return n_initial_; }

  // The attention share of the initial and recent keys, or nullopt where the layer is never
  // compressed (lazy_threshold = 1 or too few tokens).
  std::optional<double> lazy_score(const LayerInputs& inputs) const;
  // Whether the layer keeps only its initial and recent tokens.
  bool is_lazy(const LayerInputs& inputs) const;

  KV compress(const LayerInputs& inputs) const override;
  at::Tensor kept_positions(const LayerInputs& inputs) const override;

 private:
  at::Tensor lazy_positions(const LayerInputs& inputs) const;  // -> [B, Hkv, n_initial + n_recent - n_last]

  double lazy_threshold_;
  int64_t n_last_, n_recent_, n_initial_;
};

}  // namespace kvpress
