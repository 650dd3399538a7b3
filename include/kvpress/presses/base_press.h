// The press contract. A press holds only its parameters; compress() and score() are const and
// keep no state between calls.
#pragma once

#include <ATen/core/Tensor.h>

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

  // True when KV heads may keep different numbers of tokens (AdaKV, CriticalAdaKV, Compactor
  // across heads, KVCompose unstructured). Engines then store the layer head-ragged
  // (kvpress/cache.h) and call compress_ragged().
  virtual bool head_ragged() const { return false; }

  // Compresses one layer into per-head kept tokens. The default wraps compress(), so every
  // press can be called this way.
  virtual RaggedKV compress_ragged(const LayerInputs& inputs) const;

  // Fraction of the tokens removed (0 keeps everything).
  virtual double compression_ratio() const = 0;
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

  double compression_ratio() const override { return compression_ratio_; }
  void set_compression_ratio(double compression_ratio);

 private:
  double compression_ratio_;
};

}  // namespace kvpress
