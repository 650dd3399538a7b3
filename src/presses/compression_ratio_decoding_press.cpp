// CompressionRatioDecodingPress: a DecodingPress whose budget is a fraction of the tokens seen.
#include "kvpress/presses/compression_ratio_decoding_press.h"

#include <algorithm>

#include "checks.h"
#include "presses/registration.h"

namespace kvpress {

CompressionRatioDecodingPress::CompressionRatioDecodingPress(ScorerFactory make_press, double target_compression_ratio,
                                                             int64_t compression_interval,
                                                             int64_t hidden_states_buffer_size)
    : DecodingPress(std::move(make_press), compression_interval, /*target_size=*/1, hidden_states_buffer_size,
                    "CompressionRatioDecodingPress"),
      target_compression_ratio_(target_compression_ratio) {
  TORCH_CHECK(target_compression_ratio >= 0.0 && target_compression_ratio < 1.0,
              "CompressionRatioDecodingPress: target_compression_ratio must be in [0, 1), got ",
              target_compression_ratio);
}

int64_t CompressionRatioDecodingPress::target_size(int64_t tokens_seen) const {
  // kvpress: max(1, int(total_tokens_seen * (1 - target_compression_ratio))).
  return std::max<int64_t>(1,
                           static_cast<int64_t>(static_cast<double>(tokens_seen) * (1.0 - target_compression_ratio_)));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "CompressionRatioDecodingPress",
      PressKind::kDecoding,
      "compresses during decoding: every compression_interval steps, to (1 - ratio) of the tokens seen",
      {{}, {}, {}, "the inner press gets keys/values, queries of the buffered hidden states and attentions"},
      [](double r, ParamReader& p) {
        ScorerFactory inner = scorer_factory(p, kDecodingInnerPressHelp);
        CompressionRatioDecodingPress::Params d;
        p.read_all(d);
        return std::make_unique<CompressionRatioDecodingPress>(inner, r, d.compression_interval,
                                                               d.hidden_states_buffer_size);
      }};
});

}  // namespace

}  // namespace kvpress
