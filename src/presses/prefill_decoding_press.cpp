// PrefillDecodingPress: a prefill press and a DecodingPress under one name.
#include "kvpress/presses/prefill_decoding_press.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "presses/registration.h"

namespace kvpress {

PrefillDecodingPress::PrefillDecodingPress(std::shared_ptr<const BasePress> prefilling_press,
                                           std::shared_ptr<const DecodingPress> decoding_press)
    : prefilling_(std::move(prefilling_press)), decoding_(std::move(decoding_press)) {
  TORCH_CHECK(!dynamic_cast<const DecodingPress*>(prefilling_.get()),
              "PrefillDecodingPress: prefilling_press must be a prefill press, got ", prefilling_->name(),
              " (a decoding press; pass it as decoding_press)");
}

KV PrefillDecodingPress::compress(const LayerInputs& inputs) const {
  if (prefilling_) return prefilling_->compress(inputs);
  // No prefilling press: the cache is kept whole (kvpress logs a warning and returns it).
  checks::check_kv("PrefillDecodingPress.compress", inputs.keys, inputs.values);
  const int64_t b = inputs.keys.size(0), h = inputs.keys.size(1), s = inputs.keys.size(2);
  const at::Tensor all = at::arange(s, inputs.keys.options().dtype(at::kLong)).expand({b, h, s});
  return KV{inputs.keys, inputs.values, all.contiguous()};
}

RaggedKV PrefillDecodingPress::compress_ragged(const LayerInputs& inputs) const {
  if (prefilling_) return prefilling_->compress_ragged(inputs);
  return BasePress::compress_ragged(inputs);
}

std::unique_ptr<PressSequenceState> PrefillDecodingPress::new_sequence_state() const {
  return decoding_ ? decoding_->new_sequence_state() : nullptr;
}

DecodingRole PrefillDecodingPress::decoding_role() const {
  return decoding_ ? decoding_->decoding_role() : DecodingRole{};
}

bool PrefillDecodingPress::decoding_reads_cache(int64_t layer, int64_t n, int64_t tokens_seen,
                                                const PressSequenceState& state) const {
  return decoding_ && decoding_->decoding_reads_cache(layer, n, tokens_seen, state);
}

DecodingUpdate PrefillDecodingPress::decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                                     PressSequenceState& state) const {
  if (!decoding_) return BasePress::decoding_update(forward, tokens_seen, state);  // raises
  return decoding_->decoding_update(forward, tokens_seen, state);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "PrefillDecodingPress",
      PressKind::kDecoding,
      "a prefill press and a decoding press under one name",
      {{}, {}, {}, "at prefill: the prefilling press's; while decoding: the decoding press's"},
      [](double r, ParamReader& p) {
        const std::string prefilling_name =
            p.get_text("prefilling_press", "None", "press applied at prefill (parameters as prefilling_press.<name>)");
        auto prefilling = named_press(p, "prefilling_press", prefilling_name, r);
        const std::string decoding_name =
            p.get_text("decoding_press", "None",
                       "DecodingPress or CompressionRatioDecodingPress (parameters as decoding_press.<name>)");
        auto decoding_part = named_press(p, "decoding_press", decoding_name, r);
        auto decoding = std::dynamic_pointer_cast<const DecodingPress>(decoding_part);
        TORCH_CHECK(!decoding_part || decoding,
                    "PrefillDecodingPress: decoding_press must be DecodingPress or "
                    "CompressionRatioDecodingPress, got ",
                    decoding_part->name());
        return std::make_unique<PrefillDecodingPress>(prefilling, decoding);
      }};
});

}  // namespace

}  // namespace kvpress
