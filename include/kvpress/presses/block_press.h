#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// BlockPress (kvpress): block-iterative selection. n_kept = int(S·(1 - ratio)); start with
// positions [0, n_kept); for every block of block_size positions after them, score kept ∪ block
// with the inner scorer and keep the n_kept best. The inner scorer sees only the candidates' keys
// and values (kvpress's gathered hidden states are meaningless for query-based presses), so use a
// key/value scorer (KeyDiff, Knorm, ...). Attentions are not passed on (kvpress refuses them). The ratio is the inner
// press's.
class BlockPress : public ScorerWrapperPress {
 public:
  static constexpr int64_t kDefaultBlockSize = 128;

  // Its parameters besides the inner press.
  struct Params {
    int64_t block_size = kDefaultBlockSize;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"block_size", "tokens per block"}.positive(), self.block_size);
    }
  };

  // Raises unless press is non-null and block_size > 0.
  explicit BlockPress(std::shared_ptr<const ScorerPress> press, int64_t block_size = kDefaultBlockSize);
  // The registry's form: its Params (kvpress/press_params.h).
  BlockPress(std::shared_ptr<const ScorerPress> press, const Params& params)
      : BlockPress(std::move(press), params.block_size) {}

  std::string name() const override { return "BlockPress"; }
  KV compress(const LayerInputs& inputs) const override { return gather_kept(inputs); }
  at::Tensor kept_positions(const LayerInputs& inputs) const override;
  int64_t block_size() const { return block_size_; }

 private:
  int64_t block_size_;
};

}  // namespace kvpress
