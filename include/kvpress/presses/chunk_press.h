#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// ChunkPress (kvpress): the sequence is cut into chunks of chunk_length positions (the last may be
// shorter); each chunk is scored ALONE by the inner scorer (its keys, values, hidden_states and the
// matching rows of queries given for all S positions) and keeps max(1, int(len·(1 - ratio))) tokens
// per head. Like kvpress, cos/sin are not the chunk's: the inner press gets the LAST len rows of the
// tables (kvpress passes the full tables, and window presses read their tail). Attentions are not passed on (kvpress
// refuses them). The compression ratio is the inner press's.
class ChunkPress : public ChunkedWrapperPress {
 public:
  static constexpr int64_t kDefaultChunkLength = 1024;

  // Its parameters besides the inner press.
  struct Params {
    int64_t chunk_length = kDefaultChunkLength;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"chunk_length", "tokens per chunk"}, self.chunk_length);
    }
  };

  explicit ChunkPress(std::shared_ptr<const ScorerPress> press, int64_t chunk_length = kDefaultChunkLength)
      : ChunkedWrapperPress(std::move(press), chunk_length, "ChunkPress") {}
  // The registry's form: its Params (kvpress/press_params.h).
  ChunkPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : ChunkPress(std::move(press), params.chunk_length) {}

  std::string name() const override { return "ChunkPress"; }
  KV compress(const LayerInputs& inputs) const override { return gather_kept(inputs); }
  at::Tensor kept_positions(const LayerInputs& inputs) const override;
};

}  // namespace kvpress
