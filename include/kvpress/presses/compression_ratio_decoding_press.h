#pragma once

#include <cstdint>
#include <memory>

#include "kvpress/presses/decoding_press.h"

namespace kvpress {

// CompressionRatioDecodingPress (kvpress): a DecodingPress whose budget follows the tokens seen so
// far: target_size(t) = max(1, int(t · (1 − target_compression_ratio))), t = the largest position
// id + 1 (kvpress reads it from position_ids). compress() on its own takes t = S (a cache that was
// never compressed). compression_ratio() is target_compression_ratio.
class CompressionRatioDecodingPress : public DecodingPress {
 public:
  // Raises c10::Error unless 0 <= target_compression_ratio < 1 (and DecodingPress's conditions).
  static constexpr double kDefaultTargetCompressionRatio = 0.5;

  // DecodingPress's schedule without target_size (the budget is the ratio).
  struct Params : DecodingPress::Params {
    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit_fields(self, visit, /*with_target=*/false);
    }
  };

  explicit CompressionRatioDecodingPress(ScorerFactory make_press,
                                         double target_compression_ratio = kDefaultTargetCompressionRatio,
                                         int64_t compression_interval = kDefaultCompressionInterval,
                                         int64_t hidden_states_buffer_size = kDefaultHiddenStatesBufferSize);

  std::string name() const override { return "CompressionRatioDecodingPress"; }
  int64_t target_size(int64_t tokens_seen) const override;
  double compression_ratio() const override { return target_compression_ratio_; }
  double target_compression_ratio() const { return target_compression_ratio_; }

 private:
  double target_compression_ratio_;
};

}  // namespace kvpress
