#pragma once

#include <cstdint>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// ThinK (arXiv 2407.21018), kvpress's ThinKPress: prunes key channels, not tokens. Per KV head,
// channel c scores mean_w(q_c²) (the last window_size queries, averaged over the group's query
// heads) times mean_S(k_c²); the int(D · key_channel_compression_ratio) lowest channels are
// zeroed in every key. Every token is kept and the shapes do not change (as kvpress: no memory is
// freed); compose it with a token press (ComposedPress) to drop tokens too.
class ThinKPress : public BasePress {
 public:
  static constexpr double kDefaultKeyChannelCompressionRatio = 0.0;
  static constexpr int64_t kDefaultWindowSize = 32;

  struct Params {
    int64_t window_size = kDefaultWindowSize;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"window_size", "last queries whose channel magnitudes score the key channels"}.positive(),
            self.window_size);
    }
  };

  // Raises as the constructor below.
  ThinKPress(double compression_ratio, const Params& params);
  explicit ThinKPress(double key_channel_compression_ratio = kDefaultKeyChannelCompressionRatio,
                      int64_t window_size = kDefaultWindowSize);

  std::string name() const override { return "ThinKPress"; }
  double key_channel_compression_ratio() const { return key_channel_compression_ratio_; }
  int64_t window_size() const { return window_size_; }
  // kvpress's value: half the channel ratio (keys are half of the cache), the fraction of the
  // cache's bytes the pruned channels would free. No token is removed.
  double compression_ratio() const override { return key_channel_compression_ratio_ / 2; }

  // Channel scores, higher = kept: [B, Hkv, D] float32.
  at::Tensor channel_scores(const LayerInputs& inputs) const;
  // The channels compress() zeroes, [B, Hkv, int(D · ratio)] int64 ascending (ties to the lower
  // channel).
  at::Tensor pruned_channels(const LayerInputs& inputs) const;
  // Every token, keys with the pruned channels zeroed (a new tensor), values untouched.
  KV compress(const LayerInputs& inputs) const override;

 private:
  double key_channel_compression_ratio_;
  int64_t window_size_;
};

}  // namespace kvpress
