#pragma once

#include <cstdint>
#include <optional>

#include "kvpress/ops.h"
#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Random eviction, the baseline. With a seed the scores equal kvpress's RandomPress(seed) on a
// CPU cache; without one every call draws fresh scores from the default generator.
class RandomPress : public ScorerPress {
 public:
  struct Params {
    std::optional<int64_t> seed;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"seed", "seed of the CPU generator; unset draws fresh scores each call"}, self.seed);
    }
  };

  RandomPress(double compression_ratio, const Params& params) : ScorerPress(compression_ratio), params_(params) {
    check_params("RandomPress", params_);
  }
  explicit RandomPress(double compression_ratio = 0.0, std::optional<int64_t> seed = std::nullopt)
      : RandomPress(compression_ratio, Params{seed}) {}

  std::string name() const override { return "RandomPress"; }

  std::optional<int64_t> seed() const { return params_.seed; }

  // On a rank's share of the heads, its rows of the whole layer's draw.
  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  Params params_;
};

}  // namespace kvpress
