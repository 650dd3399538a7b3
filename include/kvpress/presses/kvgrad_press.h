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
};

}  // namespace kvpress
