#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "kvpress/presses/leverage_score_press.h"
#include "kvpress/presses/non_causal_attn_press.h"
#include "kvpress/presses/score_blend_press.h"

namespace kvpress {

// Compactor (Chari & Van Durme, arXiv 2507.08143), as kvpress 0.5.5's CompactorPress:
//   score = blending * z(leverage) + z(non-causal attention), blending = compression_ratio when unset,
// both scorers run on the positions between the sinks (sink_size_start first, sink_size_end last),
// sinks padded with the maximum score. A ScoreBlendPress over LeverageScorePress and
// NonCausalAttnPress. The paper's variant: blending = 0.3, and TokenSelection::kAcrossHeads
// (global top-k over heads and positions; see ScoreBlendPress::compress_ragged).
// Needs the post-RoPE queries of every position (queries, or hidden_states + q_proj + cos/sin) and
// the pre-RoPE keys (cos/sin, or hidden_states + k_proj). `seed` seeds the leverage sketch.
class CompactorPress : public ScoreBlendPress {
 public:
  static constexpr int64_t kDefaultSinkSizeStart = 8;
  static constexpr int64_t kDefaultSinkSizeEnd = 4;
  static constexpr int64_t kDefaultChunkSize = 256;
  static constexpr int64_t kDefaultSketchDimension = 48;

  struct Params {
    int64_t sink_size_start = kDefaultSinkSizeStart;
    int64_t sink_size_end = kDefaultSinkSizeEnd;
    int64_t chunk_size = kDefaultChunkSize;
    int64_t sketch_dimension = kDefaultSketchDimension;
    std::optional<double> blending;
    std::optional<int64_t> seed;
    TokenSelection selection = TokenSelection::kPerHead;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"sink_size_start", "first tokens always kept"}.non_negative(), self.sink_size_start);
      visit(ParamSpec{"sink_size_end", "last tokens always kept"}.non_negative(), self.sink_size_end);
      visit(ParamSpec{"chunk_size", "positions per non-causal attention chunk"}.positive(), self.chunk_size);
      visit(ParamSpec{"sketch_dimension", "columns of the leverage sketch"}.positive(), self.sketch_dimension);
      visit(ParamSpec{"blending", "weight of the leverage scores; None = compression_ratio (paper: 0.3)"},
            self.blending);
      visit(ParamSpec{"seed", "seed of the leverage sketch's CPU generator"}.non_negative(), self.seed);
      visit(ParamSpec{"selection",
                      "per_head (kvpress) or across_heads (the paper's global top-k; head budgets vary, head-ragged)"}
                .one_of({"per_head", "across_heads"}),
            self.selection);
    }
  };

  // Raises as the constructor below.
  CompactorPress(double compression_ratio, const Params& params);
  explicit CompactorPress(double compression_ratio = 0.0, int64_t sink_size_start = kDefaultSinkSizeStart,
                          int64_t sink_size_end = kDefaultSinkSizeEnd, int64_t chunk_size = kDefaultChunkSize,
                          int64_t sketch_dimension = kDefaultSketchDimension,
                          std::optional<double> blending = std::nullopt, std::optional<int64_t> seed = std::nullopt,
                          TokenSelection selection = TokenSelection::kPerHead);

  std::string name() const override { return "CompactorPress"; }
  int64_t sink_size_start() const { return options().sink_size_start; }
  int64_t sink_size_end() const { return options().sink_size_end; }
  int64_t chunk_size() const { return chunk_size_; }
  int64_t sketch_dimension() const { return sketch_dimension_; }
  std::optional<double> blending() const { return blending_; }
  std::optional<int64_t> seed() const { return seed_; }

  // {blending or compression_ratio, 1}: leverage, then attention.
  std::vector<double> weights() const override;

 private:
  int64_t chunk_size_;
  int64_t sketch_dimension_;
  std::optional<double> blending_;
  std::optional<int64_t> seed_;
};

}  // namespace kvpress
