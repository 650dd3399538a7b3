#pragma once

#include <memory>

#include "kvpress/presses/base_press.h"
#include "kvpress/presses/decoding_press.h"

namespace kvpress {

// PrefillDecodingPress (kvpress): one press for both phases. At prefill the engine applies
// prefilling_press (compress() delegates to it; none: the cache is kept whole); during decoding
// it runs decoding_press's step() (none: no decoding compression). Either may be null, as in
// kvpress. compression_ratio() is the prefilling press's (0 without one).
class PrefillDecodingPress : public BasePress {
 public:
  PrefillDecodingPress(std::shared_ptr<const BasePress> prefilling_press,
                       std::shared_ptr<const DecodingPress> decoding_press);

  std::string name() const override { return "PrefillDecodingPress"; }
  KV compress(const LayerInputs& inputs) const override;
  bool head_ragged() const override { return prefilling_ && prefilling_->head_ragged(); }
  RaggedKV compress_ragged(const LayerInputs& inputs) const override;
  double compression_ratio() const override { return prefilling_ ? prefilling_->compression_ratio() : 0.0; }
  const std::shared_ptr<const BasePress>& prefilling_press() const { return prefilling_; }
  const std::shared_ptr<const DecodingPress>& decoding_press() const { return decoding_; }

 private:
  std::shared_ptr<const BasePress> prefilling_;
  std::shared_ptr<const DecodingPress> decoding_;
};

// What kvpress's pipeline does with a press, for engines (kvpress::llama::generate_greedy, eval):
// the press applied at prefill (a DecodingPress: none; a PrefillDecodingPress: its prefilling
// press, possibly none; any other press: itself) ...
const BasePress* prefill_press_of(const BasePress* press);
// ... and the DecodingPress run while decoding (a DecodingPress itself, a PrefillDecodingPress's
// decoding press, else none).
const DecodingPress* decoding_press_of(const BasePress* press);

}  // namespace kvpress
