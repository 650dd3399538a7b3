#pragma once

#include <cstdint>

#include "kvpress/ops.h"
#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// StreamingLLM (arXiv 2309.17453): keeps the first n_sink tokens and the most recent ones.
// Positions are not re-rotated (kvpress's KeyRerotationPress does that).
class StreamingLLMPress : public ScorerPress {
 public:
  static constexpr int64_t kDefaultNSink = 4;

  struct Params {
    int64_t n_sink = kDefaultNSink;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"n_sink", "number of initial tokens always kept"}.non_negative(), self.n_sink);
    }
  };

  // Raises c10::Error for a parameter outside its declared range.
  StreamingLLMPress(double compression_ratio, const Params& params);
  explicit StreamingLLMPress(double compression_ratio = 0.0, int64_t n_sink = kDefaultNSink)
      : StreamingLLMPress(compression_ratio, Params{n_sink}) {}

  std::string name() const override { return "StreamingLLMPress"; }
  int64_t n_sink() const { return params_.n_sink; }

  at::Tensor score(const LayerInputs& inputs) const override {
    return ops::streaming_llm_scores(inputs.keys, params_.n_sink, compression_ratio());
  }

 private:
  Params params_;
};

}  // namespace kvpress
