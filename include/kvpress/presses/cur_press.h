#pragma once

#include <cstdint>
#include <optional>
#include <string>

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
  explicit CURPress(double compression_ratio = 0.0, int64_t num_sinks = kDefaultNumSinks,
                    LeverageType leverage_type = kDefaultLeverageType,
                    bool use_random_leverage = kDefaultUseRandomLeverage,
                    bool use_local_approximation = kDefaultUseLocalApproximation,
                    int64_t local_window_size = kDefaultLocalWindowSize, std::optional<int64_t> seed = std::nullopt);

  std::string name() const override { return "CURPress"; }
  int64_t num_sinks() const { return num_sinks_; }
  LeverageType leverage_type() const { return leverage_type_; }
  bool use_random_leverage() const { return use_random_leverage_; }
  bool use_local_approximation() const { return use_local_approximation_; }
  int64_t local_window_size() const { return local_window_size_; }

  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  int64_t num_sinks_;
  LeverageType leverage_type_;
  bool use_random_leverage_;
  bool use_local_approximation_;
  int64_t local_window_size_;
  std::optional<int64_t> seed_;
};

}  // namespace kvpress
