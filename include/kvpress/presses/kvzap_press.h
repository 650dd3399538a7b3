#pragma once

#include <string>

#include "kvpress/press_params.h"
#include "kvpress/presses/base_press.h"

namespace kvpress {

// KVzap (arXiv 2601.07891, kvpress 0.5.5's KVzapPress): a small surrogate model per layer predicts
// each token's importance from its hidden state: score [B, Hkv, S] = surrogate_layer(hidden_states)
// transposed, the surrogate linear (hidden -> Hkv) or a 2-layer MLP (Linear, exact GELU, Linear).
// kvpress downloads the authors' surrogate (nvidia/KVzap-<model_type>-<model>), trained to predict
// KVzip scores; here it is read from a local folder as kvpress's KVzapModel.save_pretrained writes
// it (model.safetensors: layers.<i>.weight/bias, or layers.<i>.0.* and layers.<i>.2.* for the
// MLP). Without a surrogate, score() raises. Scores are float32 (kvpress: the hidden states' dtype).
class KVzapPress : public ScorerPress {
 public:
  enum class ModelType { kMlp, kLinear };
  static constexpr ModelType kDefaultModelType = ModelType::kMlp;

  // Weights stacked over layers; w2/b2 undefined for a linear surrogate.
  struct Surrogate {
    at::Tensor w1;  // [num_layers, out1, hidden] float32 (out1 = Hkv, or the MLP's hidden_dim)
    at::Tensor b1;  // [num_layers, out1]
    at::Tensor w2;  // [num_layers, Hkv, hidden_dim]
    at::Tensor b2;  // [num_layers, Hkv]
  };

  struct Params {
    ModelType model_type = kDefaultModelType;
    std::string kvzap_model;  // a folder for load_surrogate; "" (none): score() raises

    template <typename Self, typename Visit>
    static void for_each_field(Self& self, Visit&& visit) {
      visit(ParamSpec{"model_type", "the surrogate: mlp or linear"}.one_of({"mlp", "linear"}), self.model_type);
      visit(ParamSpec{"kvzap_model", "folder of a KVzap surrogate as kvpress's KVzapModel.save_pretrained writes it"}
                .file(),
            self.kvzap_model);
    }
  };

  // Reads params.kvzap_model when set; raises as the constructor below.
  KVzapPress(double compression_ratio, const Params& params);
  // Raises unless a given surrogate is of `model_type` with consistent shapes.
  explicit KVzapPress(double compression_ratio = 0.0, ModelType model_type = kDefaultModelType,
                      Surrogate surrogate = {});

  // The surrogate of a KVzapModel folder (its model.safetensors), as float32. Raises c10::Error
  // naming the folder and what is wrong.
  static Surrogate load_surrogate(const std::string& folder);

  std::string name() const override { return "KVzapPress"; }
  ModelType model_type() const { return model_type_; }
  const Surrogate& surrogate() const { return surrogate_; }
  at::Tensor score(const LayerInputs& inputs) const override;  // -> [B, Hkv, S] float32

 private:
  ModelType model_type_;
  Surrogate surrogate_;
};

}  // namespace kvpress
