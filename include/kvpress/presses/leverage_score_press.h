#pragma once

#include <cstdint>
#include <optional>

#include "kvpress/ops.h"
#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Compactor's outlier scorer (arXiv 2507.08143; kvpress's LeverageScorePress): approximate ridge
// leverage of the pre-RoPE keys through a right Gaussian sketch of sketch_dimension columns,
// z-scored over the whole tensor. Keys that are geometric outliers get high scores.
//
// Pre-RoPE keys: the cached keys with RoPE inverted when cos/sin are given, else recomputed from
// hidden_states + k_proj (+ k_norm) as kvpress does. The sketch is redrawn on every call: from a
// generator seeded with `seed` (then equal to kvpress's after torch.manual_seed(seed) on a CPU
// cache), or from the default CPU generator when no seed is set.
class LeverageScorePress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultSketchDimension = ops::kDefaultSketchDimension;

  struct Params {
    int64_t sketch_dimension = kDefaultSketchDimension;
    std::optional<int64_t> seed;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"sketch_dimension", "columns of the right Gaussian sketch"}.positive(), self.sketch_dimension);
      visit(ParamSpec{"seed", "seed of the sketch's CPU generator (kvpress: torch.manual_seed before score)"}
                .non_negative(),
            self.seed);
    }
  };

  // Raises as the constructor below.
  LeverageScorePress(double compression_ratio, const Params& params);
  explicit LeverageScorePress(double compression_ratio = 0.0, int64_t sketch_dimension = kDefaultSketchDimension,
                              std::optional<int64_t> seed = std::nullopt);

  std::string name() const override { return "LeverageScorePress"; }
  // Its scores are z-scored over every head (their mean and deviation exchanged on a rank's share).
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }
  int64_t sketch_dimension() const { return sketch_dimension_; }
  std::optional<int64_t> seed() const { return seed_; }

  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  int64_t sketch_dimension_;
  std::optional<int64_t> seed_;
};

}  // namespace kvpress
