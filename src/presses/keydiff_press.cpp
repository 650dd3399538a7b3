#include "kvpress/presses/keydiff_press.h"

#include "presses/registration.h"

namespace kvpress {

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"KeyDiffPress",
                    PressKind::kScorer,
                    "keep keys least similar to the mean key direction",
                    {},
                    without_params<KeyDiffPress>};
});

}  // namespace

}  // namespace kvpress
