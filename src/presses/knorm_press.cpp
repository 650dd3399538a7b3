#include "kvpress/presses/knorm_press.h"

#include "presses/registration.h"

namespace kvpress {

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"KnormPress", PressKind::kScorer, "keep keys of smallest L2 norm", {}, without_params<KnormPress>};
});

}  // namespace

}  // namespace kvpress
