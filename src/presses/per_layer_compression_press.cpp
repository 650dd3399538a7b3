#include "kvpress/presses/per_layer_compression_press.h"

#include <ATen/ATen.h>

#include <cmath>
#include <numeric>

#include "checks.h"
#include "presses/registration.h"

namespace kvpress {

PerLayerCompressionPress::PerLayerCompressionPress(ScorerFactory make_press, std::vector<double> compression_ratios)
    : compression_ratios_(std::move(compression_ratios)) {
  constexpr const char* op = "PerLayerCompressionPress";
  TORCH_CHECK(static_cast<bool>(make_press), op,
              ": make_press (the inner press's factory) must be set, got an empty function");
  TORCH_CHECK(!compression_ratios_.empty(), op,
              ": compression_ratios must hold one ratio per layer, got an empty list");
  for (size_t i = 0; i < compression_ratios_.size(); ++i) {
    const double r = compression_ratios_[i];
    TORCH_CHECK(std::isfinite(r) && r >= 0.0 && r < 1.0, op, ": compression_ratios[", i, "] must be in [0, 1), got ",
                r);
    std::shared_ptr<const ScorerPress> press = make_press(r);
    TORCH_CHECK(press != nullptr, op, ": make_press(", r, ") must return a ScorerPress, got nullptr");
    presses_.push_back(std::move(press));
  }
}

double PerLayerCompressionPress::compression_ratio() const {
  return std::accumulate(compression_ratios_.begin(), compression_ratios_.end(), 0.0) /
         static_cast<double>(compression_ratios_.size());
}

// Every ratio's press is the same press.
HeadSpan PerLayerCompressionPress::head_span() const { return presses_.front()->head_span(); }

const ScorerPress& PerLayerCompressionPress::press_for_layer(int64_t layer_idx, int64_t num_layers) const {
  constexpr const char* op = "PerLayerCompressionPress";
  checks::check_positive(op, "num_layers", num_layers);
  TORCH_CHECK(layer_idx >= 0 && layer_idx < num_layers, op, ": layer_idx must be in [0, num_layers (", num_layers,
              ")), got ", layer_idx);
  const int64_t n = static_cast<int64_t>(presses_.size());
  if (n == 1) return *presses_.front();
  TORCH_CHECK(n == num_layers, op, ": compression_ratios must hold one ratio per layer (num_layers = ", num_layers,
              ") or a single ratio for all, got ", n);
  return *presses_[static_cast<size_t>(layer_idx)];
}

KV PerLayerCompressionPress::compress(const LayerInputs& in) const {
  checks::check_kv("PerLayerCompressionPress.compress", in.keys, in.values);
  return press_for_layer(in.layer_idx, in.num_layers).compress(in);
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

// PerLayerCompressionPress's `compression_ratios`: comma-separated numbers, one per layer; unset
// (or None) is the ratio given to make_press for every layer.
std::vector<double> ratio_list(ParamReader& p, double ratio) {
  const std::string text = p.get_text("compression_ratios", "None",
                                      "comma-separated ratios, one per layer; None = the given ratio in every layer");
  if (is_none(text)) return {ratio};
  std::optional<std::vector<double>> ratios = parse_double_list(text);
  TORCH_CHECK(ratios, p.press_name(),
              ": parameter compression_ratios must be comma-separated numbers (one per layer), got '", text, "'");
  return *ratios;
}

const Registration kRegistration([] {
  return PressEntry{"PerLayerCompressionPress",
                    PressKind::kWrapper,
                    "inner press with its own compression ratio in every layer",
                    {{}, {}, {"layer_idx", "num_layers"}},
                    [](double r, ParamReader& p) {
                      ScorerFactory make = scorer_factory(p, kInnerPressHelp);
                      return std::make_unique<PerLayerCompressionPress>(make, ratio_list(p, r));
                    }};
});

}  // namespace

}  // namespace kvpress
