#include "kvpress/presses/kvzap_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "checks.h"
#include "head_exchange.h"
#include "kvpress/io/safetensors.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr const char* kName = "KVzapPress";

const char* type_name(KVzapPress::ModelType t) { return t == KVzapPress::ModelType::kMlp ? "mlp" : "linear"; }

void check_surrogate(const std::string& where, KVzapPress::ModelType type, const KVzapPress::Surrogate& s) {
  const bool mlp = s.w2.defined();
  TORCH_CHECK(mlp == (type == KVzapPress::ModelType::kMlp), where, ": model_type is ", type_name(type),
              " but the surrogate is ", mlp ? "an mlp" : "linear");
  TORCH_CHECK(s.w1.dim() == 3 && s.b1.dim() == 2 && s.b1.size(0) == s.w1.size(0) && s.b1.size(1) == s.w1.size(1), where,
              ": the first layer must be weights [num_layers, out, hidden] and biases [num_layers, out], got ",
              checks::shape_str(s.w1), " and ", checks::shape_str(s.b1));
  if (mlp)
    TORCH_CHECK(s.w2.dim() == 3 && s.w2.size(0) == s.w1.size(0) && s.w2.size(2) == s.w1.size(1) && s.b2.dim() == 2 &&
                    s.b2.size(0) == s.w1.size(0) && s.b2.size(1) == s.w2.size(1),
                where, ": the second layer must be weights [", s.w1.size(0), ", num_kv_heads, ", s.w1.size(1),
                "] and biases [", s.w1.size(0), ", num_kv_heads], got ", checks::shape_str(s.w2), " and ",
                checks::shape_str(s.b2));
}

}  // namespace

KVzapPress::KVzapPress(double compression_ratio, const Params& params)
    : KVzapPress(compression_ratio, params.model_type,
                 params.kvzap_model.empty() ? Surrogate{} : load_surrogate(params.kvzap_model)) {}

KVzapPress::KVzapPress(double compression_ratio, ModelType model_type, Surrogate surrogate)
    : ScorerPress(compression_ratio), model_type_(model_type) {
  if (!surrogate.w1.defined()) return;
  check_surrogate(kName, model_type, surrogate);
  auto f32 = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat).contiguous() : t; };
  surrogate_ = {f32(surrogate.w1), f32(surrogate.b1), f32(surrogate.w2), f32(surrogate.b2)};
}

KVzapPress::Surrogate KVzapPress::load_surrogate(const std::string& folder) {
  const std::string path = folder + "/model.safetensors";
  const io::SafetensorsFile file = io::load_safetensors(path);
  const bool mlp = file.tensors.count("layers.0.0.weight") > 0;
  TORCH_CHECK(mlp || file.tensors.count("layers.0.weight"), kName, ": ", path,
              " holds neither layers.0.weight (linear) nor layers.0.0.weight (mlp)");
  std::vector<at::Tensor> w1, b1, w2, b2;
  const std::string where = std::string(kName) + ": " + path;
  auto get = [&](const std::string& key) { return io::required_tensor(file, key, where); };
  for (int64_t i = 0;; ++i) {
    const std::string layer = "layers." + std::to_string(i) + (mlp ? ".0." : ".");
    if (!file.tensors.count(layer + "weight")) break;
    w1.push_back(get(layer + "weight"));
    b1.push_back(get(layer + "bias"));
    if (mlp) {
      w2.push_back(get("layers." + std::to_string(i) + ".2.weight"));
      b2.push_back(get("layers." + std::to_string(i) + ".2.bias"));
    }
  }
  Surrogate s{at::stack(w1).to(at::kFloat), at::stack(b1).to(at::kFloat), {}, {}};
  if (mlp) {
    s.w2 = at::stack(w2).to(at::kFloat);
    s.b2 = at::stack(b2).to(at::kFloat);
  }
  check_surrogate(where, mlp ? ModelType::kMlp : ModelType::kLinear, s);
  return s;
}

at::Tensor KVzapPress::score(const LayerInputs& in) const {
  constexpr const char* op = "KVzapPress.score";
  checks::check_kv(op, in.keys, in.values);
  TORCH_CHECK(surrogate_.w1.defined(), op,
              ": no surrogate: give kvzap_model=DIR, a folder as kvpress's KVzapModel.save_pretrained writes it "
              "(kvpress would download nvidia/KVzap-",
              type_name(model_type_), "-<model>)");
  checks::check_defined(op, "hidden_states", in.hidden_states);
  const at::Tensor& h = in.hidden_states;
  const int64_t layers = surrogate_.w1.size(0), kv_heads = head_exchange::layer_kv_heads(in);
  TORCH_CHECK(h.dim() == 3 && h.size(0) == in.keys.size(0) && h.size(1) == in.keys.size(2), op,
              ": hidden_states must be [", in.keys.size(0), ", ", in.keys.size(2), ", hidden] to match keys, got ",
              checks::shape_str(h));
  TORCH_CHECK(in.layer_idx >= 0 && in.layer_idx < layers, op, ": layer_idx must be in [0, ", layers,
              ") (the surrogate's layers), got ", in.layer_idx);
  TORCH_CHECK(surrogate_.w1.size(2) == h.size(2), op, ": the surrogate takes hidden size ", surrogate_.w1.size(2),
              ", hidden_states have ", h.size(2));
  const int64_t out = surrogate_.w2.defined() ? surrogate_.w2.size(1) : surrogate_.w1.size(1);
  TORCH_CHECK(out == kv_heads, op, ": the surrogate predicts ", out, " heads, keys have ", kv_heads);
  const at::Device device = h.device();
  const int64_t l = in.layer_idx;
  at::Tensor x = at::linear(h.to(at::kFloat), surrogate_.w1[l].to(device), surrogate_.b1[l].to(device));
  if (surrogate_.w2.defined())
    x = at::linear(at::gelu(x), surrogate_.w2[l].to(device), surrogate_.b2[l].to(device));  // exact (erf) GELU
  // [B, S, Hkv] -> [B, Hkv, S] (the heads `in` holds)
  return head_exchange::own_rows(op, "the surrogate", x.transpose(1, 2), 1, in).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "KVzapPress",
      PressKind::kScorer,
      "KVzap: a per-layer surrogate model predicts each token's score from its hidden state (from a local folder)",
      {{{{"hidden_states"}}}, {}, {"layer_idx"}},
      from_params<KVzapPress>};
});

}  // namespace

}  // namespace kvpress
