#pragma once

#include <string>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// Q-Filters (arXiv 2503.02812, kvpress 0.5.5's QFilterPress): one filter vector per layer and KV
// head, score = -(q_filters[layer_idx, h] · k) for each cached key. kvpress downloads the authors'
// filters for a model by its name; here they come from a local safetensors file holding the tensor
// "q_filters" [num_layers, num_kv_heads, head_dim] (scripts/make_artifact.py qfilters computes them
// for a model by the paper's recipe; docs/PRESS_NOTES.md). Without filters, score() raises, as
// kvpress's does before post_init_from_model. Scores are float32 (kvpress: in the model's dtype).
class QFilterPress : public ScorerPress {
 public:
  static constexpr const char* kTensorName = "q_filters";

  struct Params {
    std::string q_filters;  // a safetensors file for load_filters; "" (none): score() raises

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"q_filters", "safetensors file with q_filters [num_layers, num_kv_heads, head_dim]"}.file(),
            self.q_filters);
    }
  };

  // Reads params.q_filters when set.
  QFilterPress(double compression_ratio, const Params& params);
  // q_filters [num_layers, num_kv_heads, head_dim] float, or undefined (none yet).
  explicit QFilterPress(double compression_ratio = 0.0, at::Tensor q_filters = {});

  // The filters of a safetensors file (tensor kTensorName, 3-d, floating point), as float32.
  // Raises c10::Error naming the file and what is wrong.
  static at::Tensor load_filters(const std::string& path);

  std::string name() const override { return "QFilterPress"; }
  const at::Tensor& q_filters() const { return q_filters_; }
  at::Tensor score(const LayerInputs& inputs) const override;

 private:
  at::Tensor q_filters_;  // [num_layers, num_kv_heads, head_dim] float32, or undefined
};

}  // namespace kvpress
