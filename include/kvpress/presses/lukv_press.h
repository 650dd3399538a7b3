#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// LU-KV (arXiv 2602.08585, kvpress 0.5.5's LUKVPress): head-wise budgets from a precomputed budget
// curve around an inner scorer. budget_curves [99, num_layers, Hkv] holds, for each target ratio
// 0.01..0.99 (row round(100·ratio) - 1, clamped to [0, 98]), the fraction of every (layer, KV head)
// to prune. In a layer of S tokens head h ideally keeps (1 - curve[t, layer, h])·S (clamped to
// [0, S]); the layer keeps round(Σ ideal) tokens (at least Hkv, at most Hkv·S): each head the floor
// of its ideal, the remainder one each to the heads of the largest fractional parts (ties: the
// lower head; kvpress: torch.topk's order), each head then clamped to [1, S]. Each head keeps its
// best inner scores, the first `sink` and last `window` positions protected (max + 1; among equal
// scores the lower position, as kvpress's stable sort). The same counts in every batch row. kvpress
// masks the other keys (no memory saved); here the heads are stored head-ragged. kvpress downloads
// the curve of a (model, scorer) pair; here it comes from a safetensors file holding
// "budget_curves" (scripts/make_artifact.py lukv-curve converts LU-KV's published .npy curves).
// The compression ratio is LU-KV's own: the inner press only scores.
class LUKVPress : public HeadRaggedWrapperPress {
 public:
  static constexpr const char* kTensorName = "budget_curves";
  static constexpr int64_t kDefaultSink = 4;
  static constexpr int64_t kDefaultWindow = 1;
  static constexpr int64_t kCurveRatios = 99;  // target ratios 0.01 .. 0.99

  // Its parameters besides the inner press and the ratio.
  struct Params {
    std::string budget_curves;  // a safetensors file for load_budget_curves; "" (none): compress raises
    int64_t sink = kDefaultSink;
    int64_t window = kDefaultWindow;

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"budget_curves", "safetensors file with budget_curves [99, num_layers, num_kv_heads]"}.file(),
            self.budget_curves);
      visit(ParamSpec{"sink", "first tokens always kept"}.non_negative(), self.sink);
      visit(ParamSpec{"window", "last tokens always kept"}.non_negative(), self.window);
    }
  };

  // budget_curves [99, num_layers, Hkv] floating, or undefined (none yet: compress raises, as kvpress
  // before its curve is loaded). Raises unless press is non-null, 0 <= compression_ratio < 1 and
  // sink, window >= 0.
  LUKVPress(std::shared_ptr<const ScorerPress> press, double compression_ratio, at::Tensor budget_curves = {},
            int64_t sink = kDefaultSink, int64_t window = kDefaultWindow);

  // The curves of a safetensors file (tensor kTensorName, [99, L, Hkv], floating), as float32.
  static at::Tensor load_budget_curves(const std::string& path);

  std::string name() const override { return "LUKVPress"; }
  double compression_ratio() const override { return compression_ratio_; }
  const at::Tensor& budget_curves() const { return budget_curves_; }

  // Tokens each KV head of layer `layer_idx` keeps out of seq_len: [Hkv] int64.
  at::Tensor head_budgets(int64_t layer_idx, int64_t num_kv_heads, int64_t seq_len) const;

  // [B, Hkv, S] bool: each head's kept positions (the complement of kvpress's masked_key_indices).
  at::Tensor keep_mask(const LayerInputs& inputs) const override;

 private:
  double compression_ratio_;
  at::Tensor budget_curves_;  // [99, L, Hkv] float32, or undefined
  int64_t sink_;
  int64_t window_;
};

}  // namespace kvpress
