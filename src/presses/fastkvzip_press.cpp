// FastKVzipPress: the gates, their scores and the KVzip family's selection (see
// include/kvpress/presses/fastkvzip_press.h and docs/PRESS_NOTES.md).
#include "kvpress/presses/fastkvzip_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/presses/kvzip_press.h"
#include "presses/head_exchange.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

using namespace checks;

constexpr const char* kName = "FastKVzipPress";

// Positions a gate scores per block: bounds the [Hkv, block, sink, G] base logits.
constexpr int64_t kGateBlock = 4096;

void check_gates(const std::string& where, const FastKVzipPress::Gates& g) {
  TORCH_CHECK(g.q_proj_weight.dim() == 3 && g.k_proj_weight.dim() == 3 && g.k_base.dim() == 4 && g.b.dim() == 3 &&
                  g.q_norm.dim() == 2 && g.k_norm.dim() == 2 && g.q_proj_bias.dim() == 2,
              where,
              ": gates must be q_proj_weight [L, Hkv * G * O, hidden], q_proj_bias [L, Hkv * G * O], k_proj_weight "
              "[L, Hkv * O, hidden], q_norm/k_norm [L, O], k_base [L, Hkv, sink, O], b [L, Hkv, G]; got ranks ",
              g.q_proj_weight.dim(), ", ", g.q_proj_bias.dim(), ", ", g.k_proj_weight.dim(), ", ", g.q_norm.dim(), "/",
              g.k_norm.dim(), ", ", g.k_base.dim(), ", ", g.b.dim());
  const int64_t layers = g.q_proj_weight.size(0), hkv = g.k_base.size(1), o = g.k_base.size(3), groups = g.b.size(2);
  const int64_t hidden = g.q_proj_weight.size(2);
  const bool ok = g.q_proj_weight.size(1) == hkv * groups * o && g.q_proj_bias.size(0) == layers &&
                  g.q_proj_bias.size(1) == hkv * groups * o && g.k_proj_weight.size(0) == layers &&
                  g.k_proj_weight.size(1) == hkv * o && g.k_proj_weight.size(2) == hidden &&
                  g.q_norm.sizes() == at::IntArrayRef{layers, o} && g.k_norm.sizes() == at::IntArrayRef{layers, o} &&
                  g.k_base.size(0) == layers && g.b.size(0) == layers && g.b.size(1) == hkv && o > 0 && hkv > 0 &&
                  groups > 0;
  TORCH_CHECK(ok, where, ": gate shapes disagree: q_proj_weight ", shape_str(g.q_proj_weight), ", q_proj_bias ",
              shape_str(g.q_proj_bias), ", k_proj_weight ", shape_str(g.k_proj_weight), ", q_norm ",
              shape_str(g.q_norm), ", k_norm ", shape_str(g.k_norm), ", k_base ", shape_str(g.k_base), ", b ",
              shape_str(g.b));
}

// The gate's Qwen3RMSNorm over the last dimension.
at::Tensor gate_norm(const at::Tensor& x, const at::Tensor& weight) {
  return weight * (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + FastKVzipPress::kGateNormEps));
}

}  // namespace

FastKVzipPress::FastKVzipPress(double compression_ratio, const Params& params)
    : FastKVzipPress(compression_ratio, params.layerwise, params.n_sink, params.window_size, params.window_ratio,
                     params.gates.empty() ? Gates{} : load_gates(params.gates)) {}

FastKVzipPress::FastKVzipPress(double compression_ratio, bool layerwise, int64_t n_sink, int64_t window_size,
                               double window_ratio, Gates gates)
    : compression_ratio_(compression_ratio),
      layerwise_(layerwise),
      n_sink_(n_sink),
      window_size_(window_size),
      window_ratio_(window_ratio) {
  check_ratio(kName, compression_ratio);
  check_params(kName, Params{layerwise, n_sink, window_size, window_ratio, {}});
  if (!gates.defined()) return;
  check_gates(kName, gates);
  auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  gates_ = {f32(gates.q_proj_weight),
            f32(gates.q_proj_bias),
            f32(gates.k_proj_weight),
            f32(gates.q_norm),
            f32(gates.k_norm),
            f32(gates.k_base),
            f32(gates.b)};
}

FastKVzipPress::Gates FastKVzipPress::load_gates(const std::string& path) {
  const io::SafetensorsFile file = io::load_safetensors(path);
  const std::string where = std::string(kName) + ": " + path;
  TORCH_CHECK(file.tensors.count("layers.0.q_proj.weight"), where, " holds no layers.0.q_proj.weight");
  std::vector<at::Tensor> parts[7];
  const char* names[7] = {
      "q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b"};
  for (int64_t i = 0; file.tensors.count("layers." + std::to_string(i) + ".q_proj.weight"); ++i)
    for (int k = 0; k < 7; ++k)
      parts[k].push_back(io::required_tensor(file, "layers." + std::to_string(i) + "." + names[k], where));
  auto stacked = [&](int k) { return at::stack(parts[k]).to(at::kFloat); };
  // The authors' k_base is [Hkv, 1, sink, O] and b [Hkv, 1, G] per layer: the 1 goes.
  Gates g{stacked(0), stacked(1), stacked(2), stacked(3), stacked(4), stacked(5), stacked(6)};
  TORCH_CHECK(g.k_base.dim() == 5 && g.k_base.size(2) == 1 && g.b.dim() == 4 && g.b.size(2) == 1, where,
              ": layers.<i>.k_base must be [Hkv, 1, sink, O] and layers.<i>.b [Hkv, 1, G], got ",
              shape_str(parts[5][0]), " and ", shape_str(parts[6][0]));
  g.k_base = g.k_base.squeeze(2);
  g.b = g.b.squeeze(2);
  check_gates(where, g);
  return g;
}

at::Tensor FastKVzipPress::layer_scores(const LayerInputs& in) const {
  constexpr const char* op = "FastKVzipPress.layer_scores";
  check_kv(op, in.keys, in.values);
  TORCH_CHECK(gates_.defined(), op,
              ": no gates: give gates=FILE, a safetensors file of the model's trained gates (kvpress would download "
              "Jang-Hyun/Fast-KVzip; scripts/make_artifact.py fastkvzip trains them, fastkvzip-convert converts the "
              "authors' .pt)");
  check_defined(op, "hidden_states", in.hidden_states);
  const at::Tensor& h = in.hidden_states;
  const int64_t s = in.keys.size(2), hkv = in.keys.size(1);
  const int64_t o = gates_.k_base.size(3), groups = gates_.b.size(2), layers = gates_.q_proj_weight.size(0);
  TORCH_CHECK(in.keys.size(0) == 1, op, ": batch must be 1 (as kvpress), got ", in.keys.size(0));
  TORCH_CHECK(h.dim() == 3 && h.size(0) == 1 && h.size(1) == s, op, ": hidden_states must be [1, ", s,
              ", hidden] to match keys, got ", shape_str(h));
  TORCH_CHECK(in.layer_idx >= 0 && in.layer_idx < layers, op, ": layer_idx must be in [0, ", layers,
              ") (the gates' layers), got ", in.layer_idx);
  TORCH_CHECK(gates_.q_proj_weight.size(2) == h.size(2), op, ": the gates take hidden size ",
              gates_.q_proj_weight.size(2), ", hidden_states have ", h.size(2));
  TORCH_CHECK(gates_.k_base.size(1) == head_exchange::layer_kv_heads(in), op, ": the gates score ",
              gates_.k_base.size(1), " heads, keys have ", head_exchange::layer_kv_heads(in),
              in.kv_head_range.layer_kv_heads > 0 ? " (every rank's)" : "");

  const at::Device device = h.device();
  const int64_t l = in.layer_idx;
  // The gates of the heads `in` holds (a tensor-parallel rank's share of the layer's).
  const auto own = [&](const at::Tensor& layer, int64_t rows_per_head) {
    return head_exchange::own_rows(op, "the gates", layer, 0, in, rows_per_head).to(device);
  };
  const at::Tensor wq = own(gates_.q_proj_weight[l], groups * o), bq = own(gates_.q_proj_bias[l], groups * o);
  const at::Tensor wk = own(gates_.k_proj_weight[l], o), qn = gates_.q_norm[l].to(device);
  const at::Tensor kn = gates_.k_norm[l].to(device), b = own(gates_.b[l], 1).view({hkv, 1, 1, groups});
  const at::Tensor k_base = own(gates_.k_base[l], 1).unsqueeze(1);  // [Hkv, 1, sink, O]
  const double scale = std::sqrt(static_cast<double>(o));
  at::Tensor scores = at::empty({1, hkv, s}, h.options().dtype(at::kFloat));
  for (int64_t t0 = 0; t0 < s; t0 += kGateBlock) {
    const int64_t n = std::min(kGateBlock, s - t0);
    const at::Tensor x = h[0].narrow(0, t0, n).to(at::kFloat);
    const at::Tensor q = gate_norm(at::linear(x, wq, bq).view({n, hkv, groups, o}), qn).permute({1, 0, 3, 2});
    const at::Tensor k = gate_norm(at::linear(x, wk).view({n, hkv, 1, o}), kn).permute({1, 0, 2, 3});
    const at::Tensor logit = at::matmul(k, q) / scale + b;  // [Hkv, n, 1, G]
    const at::Tensor base = at::matmul(k_base, q) / scale;  // [Hkv, n, sink, G]
    const at::Tensor denominator = 1 + at::exp(base - logit).sum(2, /*keepdim=*/true);
    scores[0].narrow(1, t0, n).copy_(denominator.reciprocal().mean(-1).squeeze(-1));
  }
  // The sinks and a trailing window are always kept (score 1, the largest a gate gives).
  if (n_sink_ > 0) scores.narrow(2, 0, std::min(n_sink_, s)).fill_(1.0);
  const int64_t window = s < kLongContext
                             ? std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(s) * window_ratio_))
                             : window_size_;
  scores.narrow(2, s - std::min(window, s), std::min(window, s)).fill_(1.0);
  return scores;
}

std::vector<at::Tensor> FastKVzipPress::keep_masks(const at::Tensor& scores) const {
  return kvzip_evict_lowest(scores, compression_ratio_, layerwise_, "FastKVzipPress.keep_masks");
}

namespace {
void refuse_global_selection(const char* op) {
  TORCH_CHECK(false, op,
              ": with layerwise=false the selection is global over layers, so one layer's inputs are not enough: "
              "it needs a second pass over every layer's scores (kvpress::llama::fast_kvzip_prefill, or "
              "layer_scores() for every layer, then keep_masks())");
}
}  // namespace

at::Tensor FastKVzipPress::keep_mask(const LayerInputs& inputs) const {
  if (!layerwise_) refuse_global_selection("FastKVzipPress.keep_mask");
  if (compression_ratio_ == 0.0)
    return at::ones(inputs.keys.sizes().slice(0, 3), inputs.keys.options().dtype(at::kBool));
  // The layer's evictions are taken across its heads: every rank's, on a shard with global budgets.
  const at::Tensor scores = head_exchange::all_heads(inputs, layer_scores(inputs));
  return head_exchange::own_kv_heads(
      inputs, kvzip_evict_lowest(scores[0].unsqueeze(0), compression_ratio_, true, "FastKVzipPress.keep_mask")[0]);
}

KV FastKVzipPress::compress(const LayerInputs&) const {
  if (!layerwise_) refuse_global_selection("FastKVzipPress.compress");
  refuse_uniform_compress();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "FastKVzipPress",
      PressKind::kSecondPass,
      "KVzip's importance predicted by a trained gate per layer from the attention input; evicted globally over "
      "layers and heads (layerwise: per layer)",
      {{{{"hidden_states"}}},
       {},
       {"layer_idx"},
       "every layer's gate scores before the global selection (kvpress::llama::fast_kvzip_prefill); layerwise=true "
       "compresses one layer alone"},
      from_params<FastKVzipPress>};
});

}  // namespace

}  // namespace kvpress
