#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/presses/rkv_press.h"

namespace kvpress {

// The post-RoPE queries of each layer's last window_size positions, oldest first: per layer
// [B, Hq, <= window_size, D] float32, each rotated at its own position (undefined before the layer's
// first forward). One per sequence, as DecodingState.
struct RKVQueryWindow : CopyableSequenceState<RKVQueryWindow> {
  std::vector<at::Tensor> queries;
};

// R-KV as its authors run it (github.com/Zefan-Cai/R-KV: R1KV with run_math.py's "step_length"
// schedule): a fixed budget of tokens while generating a long reasoning trace.
//   prefill   a prompt of S >= budget tokens keeps RKVPress's best budget tokens (the last
//             window_size always among them); a shorter one is kept whole. The prompt's last
//             window_size queries start the query window.
//   decoding  every forward's queries join the window (its last window_size kept). The forward
//             after the one that brought the sequence to a multiple of divide_length compresses
//             the layer, new tokens included, to `budget` with RKVPress's scores over the window's
//             queries, when it holds at least `budget` tokens.
// Unlike DecodingPress(RKVPress), whose buffered queries are all rotated at the latest position
// (kvpress's quirk), the window's queries keep their own positions, and the schedule counts the
// sequence's tokens, not steps since the last compression.
class RKVDecodingPress : public BasePress {
 public:
  static constexpr int64_t kDefaultBudget = 128;
  static constexpr int64_t kDefaultDivideLength = 128;

  struct Params : RKVPress::Params {
    int64_t budget = kDefaultBudget;
    int64_t divide_length = kDefaultDivideLength;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"budget", "tokens each head keeps after a compression (> window_size)"}.positive(), self.budget);
      visit(ParamSpec{"divide_length", "compress when the sequence's length reaches a multiple of it (B_buffer)"}
                .positive(),
            self.divide_length);
      RKVPress::Params::for_each_field(self, visit);
    }
  };

  // Raises c10::Error for a parameter outside its declared range, or budget <= window_size.
  explicit RKVDecodingPress(const Params& params);
  RKVDecodingPress();  // the authors' defaults

  std::string name() const override { return "RKVDecodingPress"; }
  double compression_ratio() const override { return 0.0; }  // set by the budget and the length
  const Params& params() const { return params_; }

  // The prefill: RKVPress's best `budget` tokens of a layer of S >= budget, else every token.
  KV compress(const LayerInputs& inputs) const override;

  // The lifecycle (BasePress): an RKVQueryWindow per sequence, started by the prefill and
  // compressing while decoding (a replacement of the layer).
  std::unique_ptr<PressSequenceState> new_sequence_state() const override;
  at::Tensor record_prefill(const LayerInputs& inputs, PressSequenceState& state) const override;
  DecodingRole decoding_role() const override;
  bool decoding_reads_cache(int64_t layer, int64_t n, int64_t tokens_seen,
                            const PressSequenceState& state) const override;
  DecodingUpdate decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                 PressSequenceState& state) const override;

  // Whether the forward of n tokens that brings the sequence to tokens_seen compresses.
  bool due(int64_t n, int64_t tokens_seen) const;

 private:
  // The layer's `budget` best tokens under RKVPress (the inputs' queries are the window's).
  KV keep_budget(const LayerInputs& inputs) const;

  Params params_;
  RKVPress scorer_;
};

}  // namespace kvpress
