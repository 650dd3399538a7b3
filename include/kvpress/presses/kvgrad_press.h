// KVgradPress (kvpress 0.5.5 kvgrad_press.py; KVgrad): KVzip's replay, with each reconstruction
// attention weighted by what the token writes into the residual stream and by how much the model's
// final hidden states depend on that stream.
//
// For a context token c in layer l, over the replay's probe rows p (and the GQA group):
//   S[l, c] = max_p A[p, c] * ||v_c W_O|| * ||d Phi / d a_p||,   Phi = sum_p ||h_p^L||^2
// A is KVzip's attention of the replay over [sinks | chunk | its own keys] (KVzipPress::chunk_scores),
// a_p the layer's attention output (after o_proj) at probe p, h^L the last decoder layer's output
// (before the final norm). The gradient needs one backward pass per replay chunk; then KVzip's
// selection. kvpress::llama::kvgrad_prefill runs it (LlamaModel::prefill calls it with
// PrefillOptions::tokenizer). KVzip+'s normalization does not apply (kvpress fixes it off).
#pragma once

#include <cstdint>
#include <string>

#include "kvpress/presses/kvzip_press.h"

namespace kvpress {

struct KVgradRunOptions {
  // false: the context's full cache is held while scoring (kvpress's way; one prefill, then per
  // replay chunk one forward and one backward through every layer). true: no more than one layer's
  // context keys/values at a time, the bound KVzipPress's pass keeps: per chunk a forward layer by
  // layer (the context alongside) that keeps only the chunk's input to each layer, then a backward
  // layer by layer, from the last, that recomputes that layer's context keys/values from the
  // embeddings. The price is compute: about L^2 / 2 extra context layer passes per chunk. The scores
  // are the same.
  bool recompute_context = false;
};

class KVgradPress : public KVzipPress {
 public:
  static constexpr int64_t kDefaultChunkSize = 512;

  // KVzipPress's parameters but kvzip_plus_normalization, with KVgrad's chunk_size.
  struct Params : KVzipPress::Params {
    Params() { chunk_size = kDefaultChunkSize; }

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit_fields(self, visit, /*with_plus=*/false);
    }
  };

  // Raises as KVzipPress.
  KVgradPress(double compression_ratio, const Params& params) : KVzipPress(compression_ratio, params) {}
  explicit KVgradPress(double compression_ratio = 0.0, bool layerwise = kDefaultLayerwise,
                       int64_t n_sink = kDefaultNSink, int64_t chunk_size = kDefaultChunkSize)
      : KVzipPress(compression_ratio, layerwise, n_sink, /*kvzip_plus_normalization=*/false, chunk_size) {}

  std::string name() const override { return "KVgradPress"; }

  // KVgrad's prefill (src/presses/kvgrad_pass.cpp): the context's plain prefill, then per replay
  // chunk one forward of the repeat with autograd through every layer and one backward of
  // Phi = sum ||h^L||^2; KVzip's chunk scores with row_scale = ||dPhi/da_p|| and column_scale =
  // ||v W_O||; KVzip's selection; then the cache is rebuilt by the compressing prefill. Runs outside
  // inference mode (it needs gradients). Peak: the full cache plus one chunk's activations in every
  // layer, or with options.recompute_context one layer's context keys/values plus the context's
  // residual stream and one chunk's input to every layer (the result's memory reports it).
  KVzipPassResult run_kvgrad_pass(SecondPassRun& run, const KVgradRunOptions& options) const;
  // run_kvgrad_pass() with the default KVgradRunOptions (the replay's query_chunk does not apply).
  KVzipPassResult run_second_pass(SecondPassRun& run, const KVzipRunOptions& options) const override;
};

}  // namespace kvpress
