#include "kvpress/presses/kvgrad_press.h"

#include "presses/registration.h"

namespace kvpress {

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "KVgradPress",
      PressKind::kSecondPass,
      "KVzip's replay weighted by ||v W_O|| and by the gradient of the final hidden states (one backward per "
      "chunk); evicted globally over layers and heads",
      {{},
       {},
       {},
       "the context replayed after a repeat prompt, with a backward pass per chunk (kvpress::llama::kvgrad_prefill)"},
      from_params<KVgradPress>};
});

}  // namespace

}  // namespace kvpress
