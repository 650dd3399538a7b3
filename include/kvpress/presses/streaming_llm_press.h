#pragma once

#include <cstdint>

#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// StreamingLLM (arXiv 2309.17453): keeps the first n_sink tokens and the most recent ones.
// Positions are not re-rotated (kvpress's KeyRerotationPress does that).
class StreamingLLMPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultNSink = 4;

  explicit StreamingLLMPress(double compression_ratio = 0.0, int64_t n_sink = kDefaultNSink);

  std::string name() const override { return "StreamingLLMPress"; }
  int64_t n_sink() const { return n_sink_; }

  at::Tensor score(const LayerInputs& inputs) const override {
    return ops::streaming_llm_scores(inputs.keys, n_sink_, compression_ratio());
  }

 private:
  int64_t n_sink_;
};

}  // namespace kvpress
