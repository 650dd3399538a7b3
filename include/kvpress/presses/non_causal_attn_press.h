#pragma once

#include <cstdint>

#include "kvpress/ops.h"
#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Compactor's attention scorer (kvpress's NonCausalAttnPress): every query attends to every key
// of its chunk of chunk_size positions (non-causal, no 1/sqrt(D)); the attention each key receives
// is summed over its chunk's queries, averaged per GQA group, weighted by ||v_i||, smoothed with a
// 3-tap average and z-scored over the whole tensor. Needs the post-RoPE queries of EVERY position:
// inputs.queries with q_len == seq_len, or hidden_states + q_proj (+ q_norm) + cos/sin (recomputed
// one chunk at a time). Peak extra memory is one chunk's logits, O(Hq * chunk_size^2).
class NonCausalAttnPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultChunkSize = ops::kDefaultNoncausalChunkSize;

  struct Params {
    int64_t chunk_size = kDefaultChunkSize;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"chunk_size", "positions per non-causal attention chunk"}.positive(), self.chunk_size);
    }
  };

  // Raises as the constructor below.
  NonCausalAttnPress(double compression_ratio, const Params& params);
  explicit NonCausalAttnPress(double compression_ratio = 0.0, int64_t chunk_size = kDefaultChunkSize);

  std::string name() const override { return "NonCausalAttnPress"; }
  // Its scores are z-scored over every head (their mean and deviation exchanged on a rank's share).
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }
  int64_t chunk_size() const { return chunk_size_; }

  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  int64_t chunk_size_;
};

}  // namespace kvpress
