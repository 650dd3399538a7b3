#pragma once

#include <cstdint>
#include <optional>

#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Random eviction, the baseline. With a seed the scores equal kvpress's RandomPress(seed) on a
// CPU cache; without one every call draws fresh scores from the default generator.
class RandomPress : public ScorerPress {
 public:
  explicit RandomPress(double compression_ratio = 0.0, std::optional<int64_t> seed = std::nullopt)
      : ScorerPress(compression_ratio), seed_(seed) {}

  std::string name() const override { return "RandomPress"; }
  std::optional<int64_t> seed() const { return seed_; }

  at::Tensor score(const LayerInputs& inputs) const override {
    return ops::random_scores(inputs.keys, seed_.value_or(-1));
  }

 private:
  std::optional<int64_t> seed_;
};

}  // namespace kvpress
