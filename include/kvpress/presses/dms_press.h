// DMSPress (kvpress 0.5.5 dms_press.py; the dense-prefill inference of Dynamic Memory
// Sparsification, arXiv 2506.05345): evict every token whose inner score is below a threshold
// once it has left a sliding window of the most recent tokens, at prefill and, with decoding,
// while generating.
//
// The inner ScorerPress scores each token when it enters the cache, from that forward's inputs
// (kvpress passes it no attention weights: neither do we). The scores of the last
// sliding_window_size tokens wait; a token leaving the window is evicted, in each KV head on its
// own, if its score < threshold. So heads keep different numbers of tokens (head-ragged) and the
// compression ratio follows the content, not a parameter (compression_ratio() is 0).
//
//   prefill   keep_mask(inputs): of S tokens, the S - window oldest are judged, the window kept.
//             prefill_window(inputs, state) also leaves the window's scores in `state` for decoding.
//   decoding  decoding_step(forward, tokens_seen, state): scores the forward's n new tokens, and
//             judges the tokens pushed out of the window (their positions returned).
//
// threshold has kvpress's default None, which kvpress cannot compare with: an unset threshold
// raises at compression. Batch rows are judged independently.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// The scores of each layer's tokens still inside the sliding window, oldest first: per layer
// [B, Hkv, w] float32 (w <= sliding_window_size; undefined before the layer's first step). One per
// sequence, from its prefill through its decoding (the engine owns it, as DecodingState).
struct DMSWindow : CopyableSequenceState<DMSWindow> {
  std::vector<at::Tensor> scores;
};

// Tokens a decoding step pushed out of the window: positions [first, first + evict.size(2)).
struct DMSEviction {
  int64_t first = 0;
  at::Tensor evict;  // [B, Hkv, m] bool: true where that head drops the token
};

class DMSPress : public HeadRaggedWrapperPress {
 public:
  static constexpr int64_t kDefaultSlidingWindowSize = 128;
  static constexpr bool kDefaultDecoding = false;

  // Its parameters besides the inner press.
  struct Params {
    std::optional<double> threshold;
    int64_t sliding_window_size = kDefaultSlidingWindowSize;
    bool decoding = kDefaultDecoding;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"threshold", "evict a token whose inner score is below it (must be set)"}, self.threshold);
      visit(ParamSpec{"sliding_window_size", "most recent tokens never evicted"}.non_negative(),
            self.sliding_window_size);
      visit(ParamSpec{"decoding", "also evict while generating"}, self.decoding);
    }
  };

  // Raises unless press is non-null, sliding_window_size >= 0 and threshold (when set) is finite.
  explicit DMSPress(std::shared_ptr<const ScorerPress> press, std::optional<double> threshold = std::nullopt,
                    int64_t sliding_window_size = kDefaultSlidingWindowSize, bool decoding = kDefaultDecoding);

  std::string name() const override { return "DMSPress"; }
  double compression_ratio() const override { return 0.0; }  // set by the threshold and the content
  std::optional<double> threshold() const { return threshold_; }
  int64_t sliding_window_size() const { return window_; }
  // Whether the press also evicts while decoding (kvpress's `decoding`).
  bool decoding() const { return decoding_; }

  // The prefill: [B, Hkv, S] bool, false for the tokens older than the window scoring below the
  // threshold.
  at::Tensor keep_mask(const LayerInputs& inputs) const override;
  // keep_mask(), and the window's scores left in window.scores[inputs.layer_idx].
  at::Tensor prefill_window(const LayerInputs& inputs, DMSWindow& window) const;

  // One decoding forward of a layer: `forward` holds the layer's cache after the forward's n tokens
  // were appended (keys/values [B, Hkv, L, D]: the last n are new), the forward's attention input
  // (hidden_states [B, n, hidden]), RoPE rows and projections as a decoding press gets them, and
  // layer_idx. tokens_seen: the position after the last new token. The new tokens are scored from
  // those inputs and queued; the ones pushed out of the window are judged.
  DMSEviction decoding_step(const LayerInputs& forward, int64_t tokens_seen, DMSWindow& window) const;

  // The lifecycle (BasePress), with decoding: a DMSWindow per sequence, filled by the prefill
  // (record_prefill: prefill_window) and judged while decoding (decoding_update: decoding_step,
  // an eviction per head). Without decoding: no state, nothing while decoding.
  std::unique_ptr<PressSequenceState> new_sequence_state() const override;
  at::Tensor record_prefill(const LayerInputs& inputs, PressSequenceState& state) const override;
  DecodingRole decoding_role() const override;
  DecodingUpdate decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                 PressSequenceState& state) const override;

 private:
  // The inner scores of the inputs' tokens (no attention weights), [B, Hkv, n] float32.
  at::Tensor scores_of(const LayerInputs& inputs, const char* op) const;
  // The prefill's keep mask; the window's scores into *window_scores when given.
  at::Tensor judge_prefill(const LayerInputs& inputs, at::Tensor* window_scores) const;
  double threshold_or_raise(const char* op) const;

  std::optional<double> threshold_;
  int64_t window_;
  bool decoding_;
};

}  // namespace kvpress
