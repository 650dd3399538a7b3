#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// CurDKV (arXiv 2509.15038), kvpress's CURPress: approximate leverage scores of the keys (‖k_i‖²)
// and values (‖v_i‖²), optionally through a random projection to 20 dimensions, normalised within
// local windows, combined (product by default), normalised over the sequence; the first num_sinks
// positions score 1.
class CURPress : public ScorerPress {
 public:
  enum class LeverageType { kKvProduct, kKey, kValue, kKvAvg };

  static constexpr int64_t kDefaultNumSinks = 4;
  static constexpr LeverageType kDefaultLeverageType = LeverageType::kKvProduct;
  static constexpr bool kDefaultUseRandomLeverage = false;
  static constexpr bool kDefaultUseLocalApproximation = true;
  static constexpr int64_t kDefaultLocalWindowSize = 16;
  static constexpr int64_t kRandomDimension = 20;  // kvpress's fixed projection width

  // `seed` (C++ only; kvpress draws from torch's global generator): seeds the CPU generator of the
  // random projection, so that it equals kvpress's draw after torch.manual_seed(seed).
  struct Params {
    int64_t num_sinks = kDefaultNumSinks;
    LeverageType leverage_type = kDefaultLeverageType;
    bool use_random_leverage = kDefaultUseRandomLeverage;
    bool use_local_approximation = kDefaultUseLocalApproximation;
    int64_t local_window_size = kDefaultLocalWindowSize;
    std::optional<int64_t> seed;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"num_sinks", "initial tokens always kept"}.non_negative(), self.num_sinks);
      visit(ParamSpec{"leverage_type", "which leverage scores the ranking uses"}.one_of(
                {"kv_product", "key", "value", "kv_avg"}),  // LeverageType's order
            self.leverage_type);
      visit(ParamSpec{"use_random_leverage", "project K and V onto 20 random Gaussian directions first"},
            self.use_random_leverage);
      visit(ParamSpec{"use_local_approximation", "normalise the scores within windows of local_window_size tokens"},
            self.use_local_approximation);
      visit(ParamSpec{"local_window_size", "window length"}.positive(), self.local_window_size);
      visit(ParamSpec{"seed",
                      "seed of the random projection's CPU generator (C++ only; unset: torch's global generator)"},
            self.seed);
    }
  };

  // Raises c10::Error for a parameter outside its declared range.
  CURPress(double compression_ratio, const Params& params);
  explicit CURPress(double compression_ratio = 0.0, int64_t num_sinks = kDefaultNumSinks,
                    LeverageType leverage_type = kDefaultLeverageType,
                    bool use_random_leverage = kDefaultUseRandomLeverage,
                    bool use_local_approximation = kDefaultUseLocalApproximation,
                    int64_t local_window_size = kDefaultLocalWindowSize, std::optional<int64_t> seed = std::nullopt)
      : CURPress(compression_ratio, Params{num_sinks, leverage_type, use_random_leverage, use_local_approximation,
                                           local_window_size, seed}) {}

  std::string name() const override { return "CURPress"; }
  int64_t num_sinks() const { return params_.num_sinks; }
  LeverageType leverage_type() const { return params_.leverage_type; }
  bool use_random_leverage() const { return params_.use_random_leverage; }
  bool use_local_approximation() const { return params_.use_local_approximation; }
  int64_t local_window_size() const { return params_.local_window_size; }

  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  Params params_;
};

}  // namespace kvpress
