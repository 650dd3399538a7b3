#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// EntropyGatedChunkKVPress (kvpress 0.5.5): ChunkKV whose chunks are gated by how evenly the
// inner scores spread inside them. The inner scorer's scores [B, Hkv, S] are summed over KV heads;
// each chunk of chunk_length tokens (a shorter remainder is its own chunk) gets its mean score and
// its normalised entropy (scores rebased to >= 0 when a chunk has negative ones). Walking chunks
// by decreasing mean score, a chunk at or above the median score and below the median entropy
// ("important but spiky") keeps only its low_entropy_chunk_length best tokens, every other chunk
// is kept whole, until max(1, int(S·(1 - ratio))) tokens are kept; budget left over goes to the
// best tokens not yet kept. The same positions are kept for every head.
// kvpress decides from batch row 0; we from the scores summed over the batch (identical for
// B = 1). Ties (equal chunk means, equal tokens) go to the earlier position; kvpress's order
// among ties is torch's. Attentions are not passed on (kvpress refuses them).
class EntropyGatedChunkKVPress : public ChunkedWrapperPress {
 public:
  static constexpr int64_t kDefaultChunkLength = 10;
  static constexpr int64_t kDefaultLowEntropyChunkLength = 4;

  // Its parameters besides the inner press.
  struct Params {
    int64_t chunk_length = kDefaultChunkLength;
    int64_t low_entropy_chunk_length = kDefaultLowEntropyChunkLength;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"chunk_length", "tokens per chunk"}, self.chunk_length);
      visit(ParamSpec{"low_entropy_chunk_length", "tokens kept from an important chunk whose scores are spiky"},
            self.low_entropy_chunk_length);
    }
  };

  // Raises unless chunk_length > low_entropy_chunk_length >= 1.
  explicit EntropyGatedChunkKVPress(std::shared_ptr<const ScorerPress> press,
                                    int64_t chunk_length = kDefaultChunkLength,
                                    int64_t low_entropy_chunk_length = kDefaultLowEntropyChunkLength);
  // The registry's form: its Params (kvpress/press_params.h).
  EntropyGatedChunkKVPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : EntropyGatedChunkKVPress(std::move(press), params.chunk_length, params.low_entropy_chunk_length) {}

  std::string name() const override { return "EntropyGatedChunkKVPress"; }
  // The chunks are chosen by scores summed over every head (exchanged on a rank's share).
  HeadSpan head_span() const override { return wider_span(HeadSpan::kExchanged, press()->head_span()); }
  int64_t low_entropy_chunk_length() const { return low_entropy_chunk_length_; }
  KV compress(const LayerInputs& inputs) const override { return gather_kept(inputs); }
  at::Tensor kept_positions(const LayerInputs& inputs) const override;

 private:
  int64_t low_entropy_chunk_length_;
};

}  // namespace kvpress
