#pragma once

#include <cstdint>
#include <string>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// R-KV (redundancy-aware KV compression for reasoning models; arXiv 2505.24133, the authors' R1KV
// in github.com/Zefan-Cai/R-KV, not in kvpress 0.5.5). A past token (all but the last w) scores
//   mix_lambda · importance − (1 − mix_lambda) · redundancy
// importance: the last w queries' logits over the past keys, max-pooled over each GQA group's query
//   heads BEFORE the softmax, softmaxed over the past keys, averaged over the w queries and
//   max-pooled over kernel_size neighbours (padding ignored);
// redundancy: per KV head, the cosine similarities of all S keys with the diagonal zeroed; in each
//   row the similarity of one "retained" column zeroed too (retain_direction "last": the last column
//   above 0.5, column 0 when none is); averaged over the rows, then softmaxed over the columns.
// The last w positions are always kept (max + 1). w = window_size clamped to the query rows given
// and to S. The similarities are computed a block of rows at a time (no [S, S] tensor).
//
// The authors compress while decoding: every 128 generated tokens to a budget of 128 tokens, the
// last 8 queries kept between steps. That is DecodingPress(RKVPress, compression_interval=128,
// target_size=128, hidden_states_buffer_size=8) here (docs/PRESS_NOTES.md).
class RKVPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultWindowSize = 8;
  static constexpr int64_t kDefaultKernelSize = 7;
  static constexpr double kDefaultMixLambda = 0.07;
  static constexpr double kDefaultRetainRatio = 0.1;
  static constexpr const char* kDefaultRetainDirection = "last";
  // cal_similarity's threshold, which R1KV leaves at its default.
  static constexpr double kSimilarityThreshold = 0.5;

  struct Params {
    int64_t window_size = kDefaultWindowSize;
    int64_t kernel_size = kDefaultKernelSize;
    double mix_lambda = kDefaultMixLambda;
    double retain_ratio = kDefaultRetainRatio;
    std::string retain_direction = kDefaultRetainDirection;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"window_size", "observation queries (always kept; clamped to the query rows given)"}.positive(),
            self.window_size);
      visit(ParamSpec{"kernel_size", "odd width of the max pooling of the importance"}.positive_odd(),
            self.kernel_size);
      visit(ParamSpec{"mix_lambda", "weight of the importance; 1 - mix_lambda weighs the redundancy"}.fraction(),
            self.mix_lambda);
      visit(
          ParamSpec{"retain_ratio", "fraction of S whose similar columns the *_percent directions consider"}.fraction(),
          self.retain_ratio);
      visit(ParamSpec{"retain_direction",
                      "which similar column of each row is not counted as redundant (the authors' cal_similarity)"}
                .one_of({"last", "first", "last_percent", "first_percent"}),
            self.retain_direction);
    }
  };

  // Raises c10::Error for a parameter outside its declared range.
  RKVPress(double compression_ratio, const Params& params);
  explicit RKVPress(double compression_ratio = 0.0, int64_t window_size = kDefaultWindowSize,
                    int64_t kernel_size = kDefaultKernelSize, double mix_lambda = kDefaultMixLambda)
      : RKVPress(compression_ratio, Params{window_size, kernel_size, mix_lambda}) {}

  std::string name() const override { return "RKVPress"; }
  const Params& params() const { return params_; }

  at::Tensor score(const LayerInputs& inputs) const override;  // -> [B, Hkv, S] float32

  // The importance term alone, before mixing: [B, Hkv, S - w] float32.
  at::Tensor importance(const LayerInputs& inputs, int64_t window) const;
  // The redundancy term alone, over every position: [B, Hkv, S] float32 (each row sums to 1).
  at::Tensor redundancy(const at::Tensor& keys) const;  // keys: [B, Hkv, S, D]

 private:
  Params params_;
};

}  // namespace kvpress
