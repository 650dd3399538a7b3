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

  // The lifecycle (BasePress): the prefilling press at prefill, the decoding press's state and
  // updates while decoding.
  const BasePress* prefill_press() const override { return prefilling_ ? prefilling_->prefill_press() : nullptr; }
  std::unique_ptr<PressSequenceState> new_sequence_state() const override;
  DecodingRole decoding_role() const override;
  bool decoding_reads_cache(int64_t layer, int64_t n, int64_t tokens_seen,
                            const PressSequenceState& state) const override;
  DecodingUpdate decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                 PressSequenceState& state) const override;

 private:
  std::shared_ptr<const BasePress> prefilling_;
  std::shared_ptr<const DecodingPress> decoding_;
};

}  // namespace kvpress
