#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// ChunkKVPress (kvpress): the inner scorer's scores [B, Hkv, S] are summed over KV heads and
// averaged per chunk of chunk_length tokens (a shorter remainder is its own chunk); the best
// max(1, int(n_chunks·(1 - ratio))) chunks are kept whole, for every head. S < chunk_length falls
// back to the inner press. kvpress picks the chunks of batch row 0 for every row; we pick them by
// the scores summed over the batch too (identical for B = 1). Ties go to the earlier chunk.
// Attentions are not passed on (kvpress refuses them). The compression ratio is the inner press's.
class ChunkKVPress : public ChunkedWrapperPress {
 public:
  static constexpr int64_t kDefaultChunkLength = 20;

  // Its parameters besides the inner press.
  struct Params {
    int64_t chunk_length = kDefaultChunkLength;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"chunk_length", "tokens per chunk"}, self.chunk_length);
    }
  };

  explicit ChunkKVPress(std::shared_ptr<const ScorerPress> press, int64_t chunk_length = kDefaultChunkLength)
      : ChunkedWrapperPress(std::move(press), chunk_length, "ChunkKVPress") {}
  // The registry's form: its Params (kvpress/press_params.h).
  ChunkKVPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : ChunkKVPress(std::move(press), params.chunk_length) {}

  std::string name() const override { return "ChunkKVPress"; }
  // The chunks are chosen by scores summed over every head (exchanged on a rank's share).
  HeadSpan head_span() const override { return wider_span(HeadSpan::kExchanged, press()->head_span()); }
  KV compress(const LayerInputs& inputs) const override { return gather_kept(inputs); }
  at::Tensor kept_positions(const LayerInputs& inputs) const override;
};

}  // namespace kvpress
