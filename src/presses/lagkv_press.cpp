#include "kvpress/presses/lagkv_press.h"

#include "checks.h"
#include "presses/registration.h"

namespace kvpress {

LagKVPress::LagKVPress(double compression_ratio, const Params& params)
    : ScorerPress(compression_ratio), params_(params) {
  check_params("LagKVPress", params_);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "LagKVPress", PressKind::kScorer, "lag-relative K/V statistics per partition", {}, from_params<LagKVPress>};
});

}  // namespace

}  // namespace kvpress
