#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Builds the inner ScorerPress at a compression ratio (the same alias as PerLayerCompressionPress's).
using ScorerFactory = std::function<std::shared_ptr<const ScorerPress>(double compression_ratio)>;

// What kvpress's DecodingPress keeps between forwards of one generation (its per-layer
// hidden-state buffer and step counter): its PressSequenceState. A fresh generation starts from a
// fresh (or reset()) state, as kvpress resets its press on leaving `with press(model)`. Layers are
// sized on first use.
struct DecodingState : CopyableSequenceState<DecodingState> {
  // Per layer: the attention inputs [B, n_i, hidden] of the forwards since the last compression,
  // oldest first (at most hidden_states_buffer_size of them; one forward may hold several tokens).
  std::vector<std::vector<at::Tensor>> hidden_states;
  // Per layer: decoding forwards since the last compression.
  std::vector<int64_t> steps;
  // Per layer (CAMPress): each cached token's attention from the decoding queries, summed over the
  // forwards since the prefill, [B, Hkv, S] (its last query's, averaged over the group's heads).
  std::vector<at::Tensor> attention_sums;
  void reset() {
    hidden_states.clear();
    steps.clear();
    attention_sums.clear();
  }
};

// DecodingPress (kvpress): compresses each layer's cache DURING DECODING, never at prefill. After
// every decoding forward of a layer (any forward that does not start at position 0) step() adds the
// forward's attention input to the layer's buffer; when compression_interval forwards have passed
// since the last compression, or the forward itself holds at least target_size tokens, the cache
// (every token, the new ones included) is cut to target_size tokens by the inner scorer, the step
// count restarts and the buffer is emptied. The buffer then keeps only its last
// hidden_states_buffer_size forwards (0: none; the current forward is still seen at compression).
//
// The inner scorer is built by the factory at the ratio that makes int(S · (1 − ratio)) equal
// target_size (kvpress's binary search, reproduced bit for bit; 0 when S <= target_size, which keeps
// the cache as is) — kvpress sets base_press.compression_ratio the same way, and some scores depend
// on it (StreamingLLMPress, CompactorPress's default blending) — and gets these inputs (kvpress hands it the buffered
// hidden states, whose length is not S):
//   keys, values      the whole cache [B, Hkv, S, D];
//   queries           [B, Hq, b, D] from the b buffered hidden states: q_proj (+ q_norm), then RoPE
//                     with the LATEST forward's cos/sin aligned to the end, a single row being
//                     broadcast to every buffered position, exactly as kvpress's window attention
//                     rotates them (with position_embeddings of the current forward only). A latest
//                     forward of 1 < n < b tokens yields queries of its n positions only;
//   attentions        the latest forward's [B, Hq, n, S] when the engine gives them;
//   num_heads, layer_idx, num_layers, inv_freq, norm_eps.
// No hidden_states and no cos/sin: after compressions the cached positions are not 0..S-1. Inner
// scorers that read keys/values (Knorm, StreamingLLM, KeyDiff, LagKV, Random) or a window of
// trailing queries (SnapKV, TOVA) run as in kvpress; those that need every position's query or
// pre-RoPE key (ExpectedAttention, LeverageScore, NonCausalAttn, Compactor) raise (in kvpress they
// fail on the shape mismatch or score the buffer instead of the cache; docs/PRESS_NOTES.md).
// Selection is the usual top-k (ties to the lower position). compression_ratio() is 0: the budget
// is absolute (see CompressionRatioDecodingPress for a relative one).
class DecodingPress : public BasePress {
 public:
  // make_press builds the inner scorer at a ratio, e.g.
  //   [](double r) { return std::make_shared<SnapKVPress>(r, 8, 5); }
  // Raises c10::Error unless it builds a non-null ScorerPress keeping equal counts per head,
  // compression_interval > 0, target_size > 0 and hidden_states_buffer_size >= 0.
  static constexpr int64_t kDefaultCompressionInterval = 512;
  static constexpr int64_t kDefaultTargetSize = 2048;
  static constexpr int64_t kDefaultHiddenStatesBufferSize = 256;

  // The schedule's parameters (the inner press is a ScorerFactory, given apart).
  struct Params {
    int64_t compression_interval = kDefaultCompressionInterval;
    int64_t target_size = kDefaultTargetSize;
    int64_t hidden_states_buffer_size = kDefaultHiddenStatesBufferSize;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit_fields(self, visit, /*with_target=*/true);
    }
    // The fields, target_size only `with_target` (CompressionRatioDecodingPress's budget is a ratio).
    template <typename Self, typename Visit>
    static void visit_fields(Self& self, Visit&& visit, bool with_target) {
      visit(ParamSpec{"compression_interval", "decoding steps between compressions"}, self.compression_interval);
      if (with_target) visit(ParamSpec{"target_size", "tokens kept per layer after a compression"}, self.target_size);
      visit(ParamSpec{"hidden_states_buffer_size", "decoding steps of hidden states kept for the inner press"},
            self.hidden_states_buffer_size);
    }
  };

  explicit DecodingPress(ScorerFactory make_press, int64_t compression_interval = kDefaultCompressionInterval,
                         int64_t target_size = kDefaultTargetSize,
                         int64_t hidden_states_buffer_size = kDefaultHiddenStatesBufferSize);

  std::string name() const override { return "DecodingPress"; }

  // One compression of a layer to target_size(S) tokens (kvpress's DecodingPress.compress).
  // inputs.hidden_states: optional [B, b, hidden] buffered attention inputs of the last b positions;
  // inputs.cos/sin: optional [n, D] RoPE rows of the latest forward; keys/values [B, Hkv, S, D].
  KV compress(const LayerInputs& inputs) const override;
  // The same with an explicit budget (> 0).
  KV compress_to(const LayerInputs& inputs, int64_t target_size) const;

  // kvpress's forward hook for one layer and one decoding forward. `forward` holds the layer's
  // cache after this forward's tokens were appended (keys/values [B, Hkv, S, D]), this forward's
  // attention input (hidden_states [B, n, hidden]), its RoPE rows (cos/sin [n, D]), q_proj
  // (+ q_norm), optionally its attention weights [B, Hq, n, S], and layer_idx / num_layers.
  // tokens_seen: the largest position id so far + 1. Returns the compressed layer when this step
  // compresses (kept_indices index the given cache), std::nullopt otherwise. keys/values are read
  // only when the step compresses (due()): an engine whose cache is not dense (PagedKVCache) may
  // leave them undefined otherwise.
  virtual std::optional<KV> step(const LayerInputs& forward, int64_t tokens_seen, DecodingState& state) const;
  // Whether step() reads the layer's keys/values on every forward, not only when it compresses
  // (CAMPress accumulates attention): an engine must then always give them.
  virtual bool reads_cache_every_step() const { return false; }

  // The lifecycle (BasePress): nothing at prefill; a DecodingState per sequence; step() while decoding.
  const BasePress* prefill_press() const override { return nullptr; }
  std::unique_ptr<PressSequenceState> new_sequence_state() const override;
  DecodingRole decoding_role() const override;
  bool decoding_reads_cache(int64_t layer, int64_t n, int64_t tokens_seen,
                            const PressSequenceState& state) const override;
  DecodingUpdate decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                 PressSequenceState& state) const override;

  // Whether step() compresses on a forward of n tokens at layer_idx, given state as it stands
  // before that step: compression_interval forwards since the last compression, or n >= the target.
  bool due(int64_t layer_idx, int64_t n, int64_t tokens_seen, const DecodingState& state) const;

  // Tokens kept at a compression after tokens_seen tokens (the fixed target_size here).
  virtual int64_t target_size(int64_t tokens_seen) const;

  double compression_ratio() const override { return 0.0; }
  // The inner scorer at ratio 0 (as built at construction).
  const std::shared_ptr<const ScorerPress>& press() const { return press_; }
  const ScorerFactory& press_factory() const { return make_press_; }
  int64_t compression_interval() const { return compression_interval_; }
  int64_t hidden_states_buffer_size() const { return hidden_states_buffer_size_; }

  // kvpress's _find_target_compression_ratio: the ratio r for which int(k_len · (1 − r)) ==
  // target (20 bisection steps from 1 − target / k_len), 0 when k_len <= target.
  static double find_target_compression_ratio(int64_t k_len, int64_t target);

 protected:
  // The inner scorer's scores of a decoding cache at `ratio` (its inputs as compress() describes them),
  // checked [B, Hkv, S] float32.
  at::Tensor inner_scores_at(const LayerInputs& inputs, double ratio, const char* op) const;
  // Subclasses with a derived budget call this with a placeholder target_size.
  DecodingPress(ScorerFactory make_press, int64_t compression_interval, int64_t target_size,
                int64_t hidden_states_buffer_size, const char* op);

 private:
  ScorerFactory make_press_;
  std::shared_ptr<const ScorerPress> press_;
  int64_t compression_interval_;
  int64_t target_size_;
  int64_t hidden_states_buffer_size_;
};

}  // namespace kvpress
