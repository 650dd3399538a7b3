#include "kvpress/presses/streaming_llm_press.h"

#include "checks.h"
#include "presses/registration.h"

namespace kvpress {

StreamingLLMPress::StreamingLLMPress(double compression_ratio, const Params& params)
    : ScorerPress(compression_ratio), params_(params) {
  check_params("StreamingLLMPress", params_);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"StreamingLLMPress",
                    PressKind::kScorer,
                    "keep n_sink first and the most recent tokens",
                    {},
                    from_params<StreamingLLMPress>};
});

}  // namespace

}  // namespace kvpress
