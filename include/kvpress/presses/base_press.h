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
  // kvpress::llama's prefill runs the pass, a paged prefill refuses the press.
  virtual bool needs_second_pass() const { return false; }

  // Fraction of the tokens removed (0 keeps everything).
  virtual double compression_ratio() const = 0;

 protected:
  // What compress() of a head-ragged press does: raises, pointing to compress_ragged().
  [[noreturn]] void refuse_uniform_compress() const;
  // compress() of a selecting press: the inputs themselves at ratio 0 (kvpress returns the cache
  // untouched), else the rows kept_positions() names, gathered.
  KV gather_kept(const LayerInputs& inputs) const;
};

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
