// CAMPress (kvpress 0.5.5 cam_press.py; Cache Merging, CaM): a DecodingPress that merges the value
// of some tokens it evicts into their kept successors before pruning.
//
// Every decoding forward of a layer adds its last query's attention over the cache (softmax in
// float32, averaged over each KV group's query heads) to a running sum per token, A[B, Hkv, S]
// (DecodingState::attention_sums; from the forward's attention weights when the engine gives them).
// When compression_interval forwards have passed and the cache holds more than target_size tokens,
// or a forward itself holds at least target_size tokens, the cache is cut to target_size:
//   1. the inner scorer scores the cache (at the ratio that keeps target_size, as DecodingPress),
//      averaged over KV heads: ONE selection for all heads; the S - target lowest are evicted;
//   2. among the evicted, the k best scored (k = forwards since the last compression; ties: the
//      later position) are merged: token i's window is the merge_budget kept tokens after it;
//   3. with probability clamp(A_i / mean A over its window, 0, 1) (a Bernoulli draw from the default
//      generator, as torch.bernoulli), v_i / |window| is added to each window token's value;
//   4. keys and values are gathered at the kept positions, and A with them.
// The hidden-state buffer and the step count are DecodingPress's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvpress/presses/decoding_press.h"

namespace kvpress {

class CAMPress : public DecodingPress {
 public:
  static constexpr int64_t kDefaultMergeBudget = 32;

  struct Params : DecodingPress::Params {
    int64_t merge_budget = kDefaultMergeBudget;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      DecodingPress::Params::for_each_field(self, visit);
      visit(ParamSpec{"merge_budget", "kept successors each merged value spreads over"}, self.merge_budget);
    }
  };

  // Raises as DecodingPress, and unless merge_budget > 0.
  CAMPress(ScorerFactory make_press, int64_t compression_interval = kDefaultCompressionInterval,
           int64_t target_size = kDefaultTargetSize, int64_t hidden_states_buffer_size = kDefaultHiddenStatesBufferSize,
           int64_t merge_budget = kDefaultMergeBudget);

  std::string name() const override { return "CAMPress"; }
  int64_t merge_budget() const { return merge_budget_; }

  // kvpress's CAMPress.forward_hook for one layer and one decoding forward (see DecodingPress::step
  // for `forward`); keys/values are read on every call.
  std::optional<KV> step(const LayerInputs& forward, int64_t tokens_seen, DecodingState& state) const override;
  bool reads_cache_every_step() const override { return true; }
  // Its kept set is the top of the inner scores averaged over every KV head of the layer (summed over
  // ranks), and its merges are drawn for every head at once (by the rank holding head 0).
  HeadSpan head_span() const override { return wider_span(HeadSpan::kExchanged, press()->head_span()); }
  // One layer on its own (one decoding step's worth): merge_and_prune to target_size with the last
  // query's attention (the given weights' last row, else recomputed) as the running attention and one
  // merge candidate; the cache as it is when it holds at most target_size tokens.
  KV compress(const LayerInputs& inputs) const override;

  // One merge-then-prune of a layer to target_size tokens (kvpress's CAMPress.compress): keys/values
  // [B, Hkv, S, D], the buffered hidden states and the latest forward's RoPE rows as DecodingPress
  // gets them, `attention_sums` [B, Hkv, S] and `merge_candidates` k. Returns the kept keys and the
  // merged, kept values (kept_indices [B, Hkv, target] ascending, the same for every head).
  KV merge_and_prune(const LayerInputs& inputs, const at::Tensor& attention_sums, int64_t merge_candidates) const;

 private:
  int64_t merge_budget_;
};

}  // namespace kvpress
