// FastKVzipPress (kvpress 0.5.5 fastkvzip_press.py; Fast KVzip, arXiv 2601.17668): KVzip's
// importance predicted from each layer's attention input by a small trained gate, no replay.
//
// Per layer, the gate reads hidden_states h [1, S, hidden] (the attention input):
//   q = RMSNorm(h W_q + b_q) viewed [S, Hkv, G, 16],   k = RMSNorm(h W_k) viewed [S, Hkv, 16]
//   logit[t, g]      = <k_t, q_t,g> / 4 + b[h, g]
//   base[t, j, g]    = <k_base[h, j], q_t,g> / 4            (j over the gate's `sink` learned keys)
//   score[h, t]      = mean_g 1 / (1 + sum_j exp(base - logit))
// (RMSNorm over the 16 dimensions, eps 1e-6, as the gate's Qwen3RMSNorm.) Then the n_sink first
// tokens and a trailing window (max(1, int(S * window_ratio)) positions, or window_size from S =
// 32000 on) get score 1, and the selection is KVzip's: the int(L * Hkv * S * ratio) lowest scores
// over all layers and heads are evicted (layerwise: int(Hkv * S * ratio) per layer), so heads and
// layers keep different amounts (head-ragged).
//
// The gates: kvpress downloads the authors' (Jang-Hyun/Fast-KVzip, trained per model); here they
// are read from a local safetensors file (load_gates: layers.<i>.q_proj.weight/.bias,
// layers.<i>.k_proj.weight, layers.<i>.q_norm.weight, layers.<i>.k_norm.weight, layers.<i>.k_base
// [Hkv, 1, sink, 16], layers.<i>.b [Hkv, 1, G]); scripts/make_artifact.py converts the authors'
// .pt files and trains gates for a new model by their recipe.
//
// layerwise: each layer's selection is its own, so the press compresses one layer from
// LayerInputs (keep_mask / compress_ragged) like any head-ragged press. Otherwise the selection
// needs every layer's scores first (needs_second_pass()): kvpress::llama::fast_kvzip_prefill
// (kvpress/llama/kvzip.h), or layer_scores() per layer then keep_masks(). Batch 1 (as kvpress).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/presses/kvzip_press.h"

namespace kvpress {

class FastKVzipPress : public BasePress {
 public:
  static constexpr bool kDefaultLayerwise = false;
  static constexpr int64_t kDefaultNSink = 4;
  static constexpr int64_t kDefaultWindowSize = 4096;
  static constexpr double kDefaultWindowRatio = 0.02;
  // From this context length on, the protected window is window_size instead of a ratio.
  static constexpr int64_t kLongContext = 32000;
  static constexpr double kGateNormEps = 1e-6;

  // Every layer's gate, stacked over layers, float32.
  struct Gates {
    at::Tensor q_proj_weight;  // [L, Hkv * G * O, hidden]
    at::Tensor q_proj_bias;    // [L, Hkv * G * O]
    at::Tensor k_proj_weight;  // [L, Hkv * O, hidden]
    at::Tensor q_norm;         // [L, O]
    at::Tensor k_norm;         // [L, O]
    at::Tensor k_base;         // [L, Hkv, sink, O]
    at::Tensor b;              // [L, Hkv, G]
    bool defined() const { return q_proj_weight.defined(); }
  };

  struct Params {
    bool layerwise = kDefaultLayerwise;
    int64_t n_sink = kDefaultNSink;
    int64_t window_size = kDefaultWindowSize;
    double window_ratio = kDefaultWindowRatio;
    std::string gates;  // a safetensors file for load_gates; "" (none): the scores raise

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"layerwise", "per-layer budgets (else global)"}, self.layerwise);
      visit(ParamSpec{"n_sink", "first tokens always kept"}.non_negative(), self.n_sink);
      visit(ParamSpec{"window_size", "trailing tokens kept from 32000 tokens on"}.positive(), self.window_size);
      visit(ParamSpec{"window_ratio", "fraction of a shorter context kept at its end"}.fraction(), self.window_ratio);
      visit(
          ParamSpec{"gates", "the model's gates, safetensors (scripts/make_artifact.py fastkvzip or fastkvzip-convert)"}
              .file(),
          self.gates);
    }
  };

  // Reads params.gates when set; raises as the constructor below.
  FastKVzipPress(double compression_ratio, const Params& params);
  // Raises unless 0 <= ratio < 1, the parameters are in their declared ranges and the gates (when
  // given) have consistent shapes.
  explicit FastKVzipPress(double compression_ratio = 0.0, bool layerwise = kDefaultLayerwise,
                          int64_t n_sink = kDefaultNSink, int64_t window_size = kDefaultWindowSize,
                          double window_ratio = kDefaultWindowRatio, Gates gates = {});

  // The gates of a safetensors file in the layout above. Raises naming the file and what is wrong.
  static Gates load_gates(const std::string& path);

  std::string name() const override { return "FastKVzipPress"; }
  double compression_ratio() const override { return compression_ratio_; }
  bool head_ragged() const override { return true; }
  bool needs_second_pass() const override { return !layerwise_; }
  // Its evictions are taken across a layer's heads (and layers): on tensor-parallel shards the
  // selection gathers every rank's scores.
  HeadSpan head_span() const override { return HeadSpan::kExchanged; }
  bool second_pass_shardable() const override { return true; }
  bool layerwise() const { return layerwise_; }
  const Gates& gates() const { return gates_; }

  // The layer's scores: its gate on inputs.hidden_states, sinks and window set to 1.
  at::Tensor layer_scores(const LayerInputs& inputs) const;  // -> [1, Hkv, S] float32
  // Every layer's selection from all layers' scores (KVzip's, without its sink bonus).
  std::vector<at::Tensor> keep_masks(const at::Tensor& scores) const;  // [L, Hkv, N] -> L x [1, Hkv, N] bool

  // layerwise only (else raise, pointing to the second pass): int(Hkv * S * ratio) lowest scores
  // of the layer evicted across its heads.
  at::Tensor keep_mask(const LayerInputs& inputs) const override;
  KV compress(const LayerInputs& inputs) const override;

  // The global selection's prefill (src/presses/kvzip_pass.cpp): KVzip's scoring pass without a
  // replay (each layer's gate reads its attention input; one layer's keys/values at a time),
  // keep_masks(), then the compressing prefill. The result's scores are the gates' (sinks and window
  // at 1). A layerwise press needs no second pass: it compresses layer by layer in the prefill.
  KVzipPassResult run_second_pass(SecondPassRun& run) const;
  void second_pass(SecondPassRun& run) const override;

 private:
  double compression_ratio_;
  bool layerwise_;
  int64_t n_sink_;
  int64_t window_size_;
  double window_ratio_;
  Gates gates_;
};

}  // namespace kvpress
