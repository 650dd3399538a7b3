#include "kvpress/presses/streaming_llm_press.h"

#include "checks.h"

namespace kvpress {

StreamingLLMPress::StreamingLLMPress(double compression_ratio, int64_t n_sink)
    : ScorerPress(compression_ratio), n_sink_(n_sink) {
  checks::check_non_negative("StreamingLLMPress", "n_sink", n_sink);
}

}  // namespace kvpress
