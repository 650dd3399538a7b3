#include "kvpress/presses/lukv_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "kvpress/io/safetensors.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

void check_curves(const char* op, const at::Tensor& c) {
  TORCH_CHECK(c.dim() == 3 && c.size(0) == LUKVPress::kCurveRatios, op, ": budget_curves must be [",
              LUKVPress::kCurveRatios, ", num_layers, num_kv_heads], got ", checks::shape_str(c));
  TORCH_CHECK(at::isFloatingType(c.scalar_type()), op, ": budget_curves must be floating point, got ", c.scalar_type());
}

}  // namespace

LUKVPress::LUKVPress(std::shared_ptr<const ScorerPress> press, double compression_ratio, at::Tensor budget_curves,
                     int64_t sink, int64_t window)
    : HeadRaggedWrapperPress(std::move(press), "LUKVPress"),
      compression_ratio_(compression_ratio),
      sink_(sink),
      window_(window) {
  checks::check_ratio("LUKVPress", compression_ratio);
  check_params("LUKVPress", Params{{}, sink, window});
  if (budget_curves.defined()) {
    check_curves("LUKVPress", budget_curves);
    budget_curves_ = budget_curves.to(at::kFloat).contiguous();
  }
}

at::Tensor LUKVPress::load_budget_curves(const std::string& path) {
  const io::SafetensorsFile file = io::load_safetensors(path);
  const std::string where = "LUKVPress: " + path;
  const at::Tensor& curves = io::required_tensor(file, kTensorName, where);
  check_curves(where.c_str(), curves);
  return curves.to(at::kFloat).contiguous();
}

at::Tensor LUKVPress::head_budgets(int64_t layer_idx, int64_t num_kv_heads, int64_t seq_len) const {
  constexpr const char* op = "LUKVPress.head_budgets";
  TORCH_CHECK(budget_curves_.defined(), op, ": no budget curves: give budget_curves=PATH, a safetensors file with '",
              kTensorName,
              "' [99, num_layers, num_kv_heads] (scripts/make_artifact.py lukv-curve converts LU-KV's .npy)");
  const int64_t layers = budget_curves_.size(1);
  TORCH_CHECK(layer_idx >= 0 && layer_idx < layers, op, ": layer_idx must be in [0, ", layers,
              ") (the curves' layers), got ", layer_idx);
  TORCH_CHECK(budget_curves_.size(2) == num_kv_heads, op, ": budget_curves has ", budget_curves_.size(2),
              " KV heads, the keys have ", num_kv_heads);
  // Row of the target ratio: round(100·ratio) - 1 (half to even, as Python's round), in [0, 98].
  const int64_t row =
      std::clamp<int64_t>(static_cast<int64_t>(std::nearbyint(compression_ratio_ * 100)) - 1, 0, kCurveRatios - 1);
  // float32 throughout, as kvpress.
  const at::Tensor ideal = (1.0 - budget_curves_[row][layer_idx]).clamp(0.0, 1.0) * static_cast<double>(seq_len);
  const int64_t total = std::clamp<int64_t>(static_cast<int64_t>(at::round(ideal.sum()).item<double>()), num_kv_heads,
                                            num_kv_heads * seq_len);
  at::Tensor budgets = at::floor(ideal).to(at::kLong);
  const int64_t remainder = total - budgets.sum().item<int64_t>();
  if (remainder > 0) {
    // One more token to each of the `remainder` heads with the largest fractional parts (ties: the lower head).
    const at::Tensor fractional = ideal - at::floor(ideal);
    const at::Tensor order = std::get<1>(fractional.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
    budgets.index_add_(0, order.narrow(0, 0, std::min(remainder, num_kv_heads)),
                       at::ones({std::min(remainder, num_kv_heads)}, budgets.options()));
  }
  return budgets.clamp_(1, seq_len);
}

at::Tensor LUKVPress::keep_mask(const LayerInputs& in) const {
  constexpr const char* op = "LUKVPress.compress_ragged";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio_ == 0.0) return budget::keep_everything(in);
  const int64_t kv_heads = in.keys.size(1), seq = in.keys.size(2);
  // The layer's budgets (from the curves alone), of the heads `in` holds.
  const at::Tensor budgets =
      head_exchange::own_rows(op, "budget_curves", head_budgets(in.layer_idx, head_exchange::layer_kv_heads(in), seq),
                              0, in)
          .to(in.keys.device());
  at::Tensor scores = inner_scores(in, op).clone();
  // The first `sink` and last `window` positions protected, as kvpress: max + 1.
  const double protect = scores.max().item<double>() + 1;
  if (sink_ > 0) scores.narrow(2, 0, std::min(sink_, seq)).fill_(protect);
  if (window_ > 0) scores.narrow(2, std::max<int64_t>(0, seq - window_), std::min(window_, seq)).fill_(protect);
  // Each head keeps its budget of best scores; among equal scores the lower position (a stable sort).
  const at::Tensor order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/2, /*descending=*/true));
  const at::Tensor rank = at::arange(seq, order.options()).view({1, 1, seq});
  const at::Tensor keep_sorted = rank < budgets.view({1, kv_heads, 1});
  return at::zeros(scores.sizes(), keep_sorted.options()).scatter_(2, order, keep_sorted.expand_as(order));
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "LUKVPress",
      PressKind::kWrapper,
      "LU-KV: head budgets from a precomputed budget curve (read from budget_curves) around an inner scorer; "
      "head-ragged",
      {pre_rope_query_inputs().alternatives,
       {},
       {"layer_idx"},
       "the inputs of its default inner press, ExpectedAttentionPress (another inner press reads its own); the curve "
       "comes from the file named by budget_curves, its row from layer_idx; the ratio is LU-KV's own"},
      [](double r, ParamReader& p) {
        // kvpress's default inner press is ExpectedAttentionPress(epsilon=2e-2), scoring only (ratio 0).
        const std::string inner = p.get_text("press", "ExpectedAttentionPress",
                                             "inner ScorerPress (its parameters as press.<name>; an "
                                             "ExpectedAttentionPress gets epsilon=0.02 unless press.epsilon is given)");
        std::map<std::string, std::string> inner_params = p.take_prefixed("press.");
        double inner_ratio = 0.0;
        if (const auto it = inner_params.find("compression_ratio"); it != inner_params.end()) {
          inner_ratio = p.ratio("press.compression_ratio", it->second);
          inner_params.erase(it);
        }
        if (inner == "ExpectedAttentionPress" && !inner_params.count("epsilon")) inner_params["epsilon"] = "0.02";
        auto scorer = as_scorer(make_press(inner, inner_ratio, inner_params), p.press_name(), inner);
        LUKVPress::Params params;
        p.read_all(params);
        const std::string& path = params.budget_curves;
        return std::make_unique<LUKVPress>(std::move(scorer), r,
                                           path.empty() ? at::Tensor() : LUKVPress::load_budget_curves(path),
                                           params.sink, params.window);
      }};
});

}  // namespace

}  // namespace kvpress
