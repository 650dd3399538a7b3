// The press contract and the base classes of the repeated press shapes. A press holds only its
// parameters; compress() and score() are const and keep no state between calls.
//
// Thread safety: a press is immutable after construction (its parameters, and const inner presses
// held by shared_ptr), so one press object may be shared by any number of threads calling
// compress(), compress_ragged(), keep_mask() and score() at once, on the same or different inputs
// (tests/test_concurrency.cpp). The two setters are not synchronised: configure a press, then
// share it — ScorerPress::set_compression_ratio and QSMPress::set_token_text must not be called
// while another thread uses the press. A shared QSMPress/CTRPress calls its TokenTextFn from every
// thread that compresses with it, so that function must be safe to call concurrently (a const
// llama::Tokenizer's decode is). Presses with a `seed` parameter left unset draw from libtorch's
// default CPU generator, which libtorch locks: concurrent calls are safe but their draws
// interleave, so only seeded calls are reproducible. make_press() and list_presses() may be
// called from any thread (kvpress/registry.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "kvpress/types.h"

namespace kvpress {

class BasePress;
class SecondPassRun;  // kvpress/model_view.h

// What a press keeps about one sequence between the forwards of its generation (DecodingPress's
// hidden-state buffer, DMSPress's window of scores). Presses are const and stateless, so the
// engine owns one state per sequence (from BasePress::new_sequence_state(), used by one thread at
// a time), hands it to every forward of that sequence and drops it when the sequence ends. The
// engine never looks inside.
class PressSequenceState {
 public:
  virtual ~PressSequenceState() = default;
  // A copy to go back to when a forward fails part-way. Presses replace a state's tensors and never
  // write into them, so a copy that shares the tensors is a snapshot.
  virtual std::unique_ptr<PressSequenceState> snapshot() const = 0;
  // Becomes `snapshot` (from this state's snapshot()).
  virtual void restore(const PressSequenceState& snapshot) = 0;
};

// snapshot() and restore() of a copyable state type.
template <typename Derived>
class CopyableSequenceState : public PressSequenceState {
 public:
  std::unique_ptr<PressSequenceState> snapshot() const override {
    return std::make_unique<Derived>(static_cast<const Derived&>(*this));
  }
  void restore(const PressSequenceState& snapshot) override {
    static_cast<Derived&>(*this) = static_cast<const Derived&>(snapshot);
  }
};

// How a press takes part in decoding (BasePress::decoding_role()): what an engine must give its
// decoding_update() and what it may get back.
struct DecodingRole {
  // decoding_update() may change a layer's cache; false: the engine never calls it. A press that
  // compresses keeps a state (new_sequence_state() is not nullptr).
  bool compresses = false;
  // The press whose needs decide whether decoding_update() gets the forward's attention weights:
  // always when kvpress::needs_attentions(scorer->name()), else when the engine computes them anyway.
  // nullptr: never (the press reads none).
  const BasePress* scorer = nullptr;
  // Its updates evict positions per KV head (DecodingUpdate::kEvict), which a head-ragged layer
  // takes; otherwise they replace the layer (kReplace), which must be dense.
  bool evicts_per_head = false;
  // decoding_update() reads the layer's whole cache on every forward, not only when it compresses.
  bool reads_cache_every_step = false;
  // decoding_update() needs what record_prefill() kept (RKVDecodingPress's query window): an engine
  // must call record_prefill() at the prefill of every sequence.
  bool records_prefill = false;
  // Its updates are kKeepEveryLayer (one selection for the whole model, TriAttentionPress): the engine
  // calls decoding_update() for every layer of every decoding forward, in layer order, and applies
  // the update the last layer returns to every layer (each layer's attention of that forward has run).
  bool keeps_every_layer = false;
};

// What one decoding forward's press hook does to a layer's cache.
struct DecodingUpdate {
  enum class Kind {
    kNone,     // nothing
    kReplace,  // the layer becomes `replacement` (kept_indices index the cache the press saw)
    kEvict,    // each head drops the positions [evict_first, evict_first + m) where `evict` is true
    // Every layer keeps, in each head, the cache slots `keep` (DecodingRole::keeps_every_layer: the
    // layers hold the same tokens in the same slots, and the forward's last layer returns this).
    kKeepEveryLayer,
  };
  Kind kind = Kind::kNone;
  KV replacement;
  int64_t evict_first = 0;
  at::Tensor evict;  // [B, Hkv, m] bool
  at::Tensor keep;   // [B, Hkv, k] int64 slots, ascending per head (kKeepEveryLayer)
};

// Whether a press's kept tokens for one KV head depend on other KV heads (what sharding a layer's
// heads across tensor-parallel ranks needs to know; kvpress/distributed.h). tests/test_head_span.cpp
// checks every registered press's declaration.
enum class HeadSpan {
  // Each head's kept tokens depend only on its own keys/values and its query heads' inputs (and on
  // what every head shares: hidden states, RoPE tables, positions).
  kPerHead,
  // Scores or budgets span the layer's heads (a mean over every query head, a top-k across heads):
  // on a rank's share of the heads the press reaches the others through LayerInputs::head_exchange.
  kExchanged,
  // Needs every head of the layer in a way it does not exchange: a rank's share cannot be compressed
  // as part of the layer, and ShardedPress refuses it (CAMPress: its kept set is the top of scores
  // averaged over every KV head; a press of an engine's own may say so too). (Per-head data of the whole layer, a file
  // of per-head filters or a draw per
  // head, is no reason: presses take their share's rows of it, LayerInputs::kv_head_range.)
  kWholeLayer,
};
const char* head_span_name(HeadSpan span);  // "per_head", "exchanged", "whole_layer"
// The wider of two spans (per_head < exchanged < whole_layer): a press built of both.
HeadSpan wider_span(HeadSpan a, HeadSpan b);

class BasePress {
 public:
  virtual ~BasePress() = default;

  // kvpress class name, e.g. "SnapKVPress".
  virtual std::string name() const = 0;

  // Compresses one layer. The returned keys/values replace the layer's cache. Presses whose KV
  // heads keep different numbers of tokens (head_ragged()) raise here: use compress_ragged().
  virtual KV compress(const LayerInputs& inputs) const = 0;

  // compress() inside the layer's own buffers: each head's kept tokens move to the front of
  // inputs.keys / inputs.values themselves (positions 0..n_kept-1; what lies after is unspecified
  // afterwards) and the result's keys/values are views of those fronts. Same kept tokens and
  // kept_indices as compress(). For a press whose compression is a selection (kept_positions()
  // defined) no K/V is allocated on CPU (ops::compact_kv_in_place); for the others compress()'s
  // result is copied into the front. The caller owns the buffers (no one else may read them
  // meanwhile) and they must have one row per token (stride 1 along D). Head-ragged presses raise,
  // as compress() does.
  KV compress_in_place(const LayerInputs& inputs) const;

  // The positions compress() keeps, [B, Hkv, n_kept] int64 ascending per head, without moving a
  // token: for presses whose compression is a selection of unchanged tokens (every ScorerPress,
  // BlockPress, ChunkPress, ChunkKVPress, PyramidKVPress). Undefined (the default) for a press that
  // changes what it keeps (KeyRerotationPress rotates the kept keys, KVComposePress builds composite
  // tokens) or has not said it selects.
  virtual at::Tensor kept_positions(const LayerInputs& inputs) const;

  // True when KV heads may keep different numbers of tokens (AdaKV, CriticalAdaKV, Compactor
  // across heads, KVCompose unstructured). Engines then store the layer head-ragged
  // (kvpress/cache.h) and call compress_ragged().
  virtual bool head_ragged() const { return false; }

  // [B, Hkv, S] bool: the positions each head keeps. Head-ragged presses define it; the default
  // derives it from compress().
  virtual at::Tensor keep_mask(const LayerInputs& inputs) const;

  // Compresses one layer into per-head kept tokens: the gather of keep_mask() for head-ragged
  // presses, else per-head views of compress(), so every press can be called this way.
  virtual RaggedKV compress_ragged(const LayerInputs& inputs) const;

  // Whether its kept tokens span KV heads (HeadSpan). The default: per head.
  virtual HeadSpan head_span() const { return HeadSpan::kPerHead; }

  // True when compress() re-rotates the kept keys to the positions 0..n_kept-1 (KeyRerotationPress):
  // the engine then continues at position n_kept instead of S, as kvpress's pipeline does.
  virtual bool rerotates_keys() const { return false; }
  // The position id of the token after a layer of seq_len positions compressed to n_kept: seq_len,
  // or n_kept after a press that re-rotates keys. The one rule every cache follows.
  int64_t position_after(int64_t seq_len, int64_t n_kept) const { return rerotates_keys() ? n_kept : seq_len; }

  // True when the press observes the user's question at the end of the prefill (FinchPress): the
  // engine must prefill context then question and set LayerInputs::question_length.
  virtual bool observes_question() const { return false; }

  // True when one layer's inputs are not enough: the press runs the model again over the context
  // before it can compress (KVComposePress's task prompt, KVzipPress's replay). compress() raises;
  // the runner hands the whole prefill to second_pass(); a paged prefill refuses the press.
  virtual bool needs_second_pass() const { return false; }
  // The prefill of a press that needs_second_pass(): its passes over run.model(), then the cache
  // filled through `run` (kvpress/model_view.h). Raises for any other press.
  virtual void second_pass(SecondPassRun& run) const;
  // True when second_pass() runs on a tensor-parallel rank's view of the model (ModelView::
  // head_exchange, kv_head_range) and keeps what the whole model's pass keeps of the rank's heads
  // (KVComposePress, the KVzip family). Other second-pass presses are refused on a shard.
  virtual bool second_pass_shardable() const { return false; }

  // Fraction of the tokens removed (0 keeps everything).
  virtual double compression_ratio() const = 0;

  // ---- The lifecycle an engine drives (docs/INTEGRATION.md) ----
  // One press per sequence, from its prefill through its decoding:
  //   state = press.new_sequence_state()              (nullptr: the press keeps none)
  //   prefill, per layer: press.prefill_press()'s compression; with a state, record_prefill() first
  //   each decoding forward, per layer, when decoding_role().compresses: decoding_update()

  // The press applied at prefill: itself (the default); nullptr for a press that only compresses
  // while decoding (DecodingPress); a PrefillDecodingPress's prefilling press.
  virtual const BasePress* prefill_press() const { return this; }
  // A fresh state for one sequence, or nullptr when the press keeps none between forwards.
  virtual std::unique_ptr<PressSequenceState> new_sequence_state() const { return nullptr; }
  // The prefill of a press whose state starts there (DMSPress's window): records in `state` what
  // decoding will need and returns keep_mask(inputs). Undefined (the default): the state takes
  // nothing from the prefill, and the engine compresses as usual.
  virtual at::Tensor record_prefill(const LayerInputs& inputs, PressSequenceState& state) const;
  virtual DecodingRole decoding_role() const { return {}; }
  // Whether decoding_update() of a forward of n tokens at `layer` reads the layer's whole cache,
  // given `state` as it stands before the call (an engine whose cache is not dense makes the copy
  // only then). False (the default): it reads this forward's new keys/values only.
  virtual bool decoding_reads_cache(int64_t layer, int64_t n, int64_t tokens_seen,
                                    const PressSequenceState& state) const;
  // One decoding forward of one layer, right after its attention (kvpress's forward hook while
  // decoding). `forward`: this forward's attention input (hidden_states [B, n, hidden]), RoPE rows
  // (cos/sin [n, D]), projections, layer_idx / num_layers, attention weights [B, Hq, n, L] as
  // decoding_role() asks, and keys/values [B, Hkv, L, D]: the layer's cache after this forward's
  // tokens were appended when decoding_reads_cache(), else those n tokens' alone. tokens_seen: the
  // largest position id so far + 1. Raises for a press that does not compress while decoding.
  virtual DecodingUpdate decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                         PressSequenceState& state) const;

 protected:
  // What compress() of a head-ragged press does: raises, pointing to compress_ragged().
  [[noreturn]] void refuse_uniform_compress() const;
  // compress() of a selecting press: the inputs themselves at ratio 0 (kvpress returns the cache
  // untouched), else the rows kept_positions() names, gathered.
  KV gather_kept(const LayerInputs& inputs) const;
};

// The press applied at prefill: press->prefill_press(), nullptr for no press.
inline const BasePress* prefill_press_of(const BasePress* press) { return press ? press->prefill_press() : nullptr; }
// A fresh state for one sequence of `press` (press->new_sequence_state()), nullptr for no press.
inline std::unique_ptr<PressSequenceState> new_sequence_state_of(const BasePress* press) {
  return press ? press->new_sequence_state() : nullptr;
}

// `state` as `press`'s own state type (a const State for a const state). An engine hands a press the
// state its new_sequence_state() made; another press's raises.
template <typename State, typename Given>
State& own_sequence_state(Given& state, const BasePress& press) {
  auto* own = dynamic_cast<State*>(&state);
  TORCH_CHECK(own != nullptr, press.name(),
              ": the sequence state must come from this press's new_sequence_state(), got another press's");
  return *own;
}

// A press that scores every cached token and keeps the int(S * (1 - ratio)) best per KV head
// (at least one). Selection: ties go to the lower position; kept positions are ascending.
class ScorerPress : public BasePress {
 public:
  // Raises c10::Error unless 0 <= compression_ratio < 1.
  explicit ScorerPress(double compression_ratio);

  // [B, Hkv, S] float32, higher = keep.
  virtual at::Tensor score(const LayerInputs& inputs) const = 0;

  KV compress(const LayerInputs& inputs) const override;
  at::Tensor kept_positions(const LayerInputs& inputs) const override;  // the n_kept best scores

  double compression_ratio() const override { return compression_ratio_; }
  // Not synchronised: no other thread may use the press meanwhile (see the top of this file).
  void set_compression_ratio(double compression_ratio);

 private:
  double compression_ratio_;
};

// A press built around an inner ScorerPress (kvpress's wrappers: KeyRerotationPress,
// ChunkKVPress, ChunkPress, BlockPress, AdaKVPress, CriticalAdaKVPress). Its compression ratio is
// the inner press's.
class ScorerWrapperPress : public BasePress {
 public:
  double compression_ratio() const override { return press_->compression_ratio(); }
  const std::shared_ptr<const ScorerPress>& press() const { return press_; }
  // The inner press's (a wrapper that spans heads itself widens it).
  HeadSpan head_span() const override { return press_->head_span(); }

 protected:
  // Raises "<wrapper_name>: press must be a ScorerPress, got nullptr" for a null press.
  ScorerWrapperPress(std::shared_ptr<const ScorerPress> press, const char* wrapper_name);

  // The inner press's scores, checked to be [B, Hkv, S] and finite, as float32. `op` prefixes
  // error messages.
  at::Tensor inner_scores(const LayerInputs& inputs, const char* op) const;

  // `inputs` without attentions (for inner presses that must not see them).
  static LayerInputs without_attentions(const LayerInputs& inputs);

 private:
  std::shared_ptr<const ScorerPress> press_;
};

// A wrapper that cuts the sequence into chunks of chunk_length positions, the last one possibly
// shorter (ChunkPress, ChunkKVPress). Attentions are not passed on to the inner press (kvpress
// refuses them: they would not match a chunk).
class ChunkedWrapperPress : public ScorerWrapperPress {
 public:
  int64_t chunk_length() const { return chunk_length_; }

 protected:
  // Raises unless press is non-null and chunk_length > 0.
  ChunkedWrapperPress(std::shared_ptr<const ScorerPress> press, int64_t chunk_length, const char* wrapper_name);

 private:
  int64_t chunk_length_;
};

// A wrapper whose KV heads keep different numbers of tokens (AdaKVPress, CriticalAdaKVPress): it
// defines keep_mask(); compress() raises and compress_ragged() gathers the mask.
class HeadRaggedWrapperPress : public ScorerWrapperPress {
 public:
  bool head_ragged() const final { return true; }
  KV compress(const LayerInputs& inputs) const final;  // raises: use compress_ragged()
  at::Tensor keep_mask(const LayerInputs& inputs) const override = 0;

 protected:
  using ScorerWrapperPress::ScorerWrapperPress;
};

}  // namespace kvpress
