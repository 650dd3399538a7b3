#include "kvpress/presses/random_press.h"

#include "presses/registration.h"

namespace kvpress {

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "RandomPress", PressKind::kScorer, "uniform random scores (baseline)", {}, from_params<RandomPress>};
});

}  // namespace

}  // namespace kvpress
