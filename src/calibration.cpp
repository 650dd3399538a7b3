#include "kvpress/calibration.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "checks.h"

namespace kvpress::calibration {

at::Tensor attention_output(const at::Tensor& queries, const at::Tensor& query_positions, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& key_positions) {
  constexpr const char* op = "attention_output";
  checks::check_kv(op, keys, values);
  checks::check_queries(op, queries, keys, "n_queries");
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), m = keys.size(2), dim = keys.size(3);
  const int64_t heads = queries.size(1), n = queries.size(2);
  TORCH_CHECK(query_positions.dim() == 1 && query_positions.size(0) == n, op, ": query_positions must be [", n,
              "], got ", checks::shape_str(query_positions));
  TORCH_CHECK((key_positions.dim() == 1 && key_positions.size(0) == m) ||
                  (key_positions.dim() == 3 && key_positions.size(0) == batch && key_positions.size(1) == kv_heads &&
                   key_positions.size(2) == m),
              op, ": key_positions must be [", m, "] or [", batch, ", ", kv_heads, ", ", m, "], got ",
              checks::shape_str(key_positions));
  const int64_t group = heads / kv_heads;
  // Query heads of a group share their KV head: fold them into the row dimension.
  const at::Tensor q = queries.to(at::kFloat).reshape({batch, kv_heads, group * n, dim});
  at::Tensor logits = at::matmul(q, keys.to(at::kFloat).transpose(2, 3)) / std::sqrt(static_cast<double>(dim));
  const at::Tensor qpos = query_positions.to(keys.device()).repeat({group}).view({1, 1, group * n, 1});
  const at::Tensor kpos = key_positions.dim() == 1 ? key_positions.to(keys.device()).view({1, 1, 1, m})
                                                   : key_positions.to(keys.device()).view({batch, kv_heads, 1, m});
  logits.masked_fill_(kpos > qpos, -std::numeric_limits<float>::infinity());
  const at::Tensor probs = at::softmax(logits, -1).nan_to_num(0.0);  // a row that sees nothing -> 0
  return at::matmul(probs, values.to(at::kFloat)).reshape({batch, heads, n, dim});
}

namespace {

at::Tensor full_output(const ObservedLayer& layer) {
  const at::Tensor& k = layer.inputs.keys;
  return attention_output(layer.queries, layer.query_positions, k, layer.inputs.values,
                          at::arange(k.size(2), k.options().dtype(at::kLong)));
}

double quality_against(const std::vector<ObservedLayer>& layers, const std::vector<at::Tensor>& full,
                       const BasePress& press) {
  TORCH_CHECK(!layers.empty(), "attention_output_quality: layers must be non-empty");
  double err2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const KV kv = press.compress(layers[i].inputs);
    const at::Tensor out =
        attention_output(layers[i].queries, layers[i].query_positions, kv.keys, kv.values, kv.kept_indices);
    err2 += (out - full[i]).pow(2).sum().item<double>();
    ref2 += full[i].pow(2).sum().item<double>();
  }
  TORCH_CHECK(ref2 > 0.0, "attention_output_quality: the full-cache attention output is zero");
  return 1.0 - std::sqrt(err2 / ref2);
}

}  // namespace

double attention_output_quality(const std::vector<ObservedLayer>& layers, const BasePress& press) {
  std::vector<at::Tensor> full;
  for (const auto& layer : layers) full.push_back(full_output(layer));
  return quality_against(layers, full, press);
}

SearchResult search_max_ratio(const QualityFn& quality, double tolerance, const SearchOptions& options) {
  constexpr const char* op = "search_max_ratio";
  TORCH_CHECK(static_cast<bool>(quality), op, ": quality must be a function, got an empty one");
  TORCH_CHECK(std::isfinite(tolerance) && tolerance >= 0.0, op, ": tolerance must be >= 0, got ", tolerance);
  TORCH_CHECK(options.max_ratio > 0.0 && options.max_ratio < 1.0, op, ": max_ratio must be in (0, 1), got ",
              options.max_ratio);
  TORCH_CHECK(options.grid_points >= 1, op, ": grid_points must be >= 1, got ", options.grid_points);
  TORCH_CHECK(options.resolution > 0.0, op, ": resolution must be > 0, got ", options.resolution);
  TORCH_CHECK(options.max_evaluations >= options.grid_points + 1, op, ": max_evaluations must be >= grid_points + 1 (",
              options.grid_points + 1, "), got ", options.max_evaluations);

  SearchResult result;
  auto evaluate = [&](double ratio) {
    const double q = quality(ratio);
    TORCH_CHECK(!std::isnan(q), op, ": quality(", ratio, ") is NaN");
    result.evaluations.emplace_back(ratio, q);
    return q;
  };
  const double threshold = evaluate(0.0) - tolerance;
  double pass = 0.0, pass_quality = result.evaluations.front().second;
  double fail = -1.0;
  // Coarse scan from the bottom: stop at the first failing grid point.
  for (int i = 1; i <= options.grid_points; ++i) {
    const double r = options.max_ratio * i / options.grid_points;
    const double q = evaluate(r);
    if (q < threshold) {
      fail = r;
      break;
    }
    pass = r;
    pass_quality = q;
  }
  // Bisect between the last passing and the first failing ratio.
  while (fail > 0.0 && fail - pass > options.resolution &&
         static_cast<int>(result.evaluations.size()) < options.max_evaluations) {
    const double mid = 0.5 * (pass + fail);
    const double q = evaluate(mid);
    if (q >= threshold) {
      pass = mid;
      pass_quality = q;
    } else {
      fail = mid;
    }
  }
  result.ratio = pass;
  result.quality = pass_quality;
  return result;
}

ObservedLayer observe_last(const LayerInputs& inputs, int64_t n) {
  constexpr const char* op = "observe_last";
  const at::Tensor& q = inputs.queries;
  TORCH_CHECK(q.defined() && q.dim() == 4, op,
              ": inputs.queries must be [batch, num_heads, seq_len, head_dim] (the observation queries are their last "
              "rows), got ",
              q.defined() ? checks::shape_str(q) : std::string("none"));
  TORCH_CHECK(n >= 1 && q.size(2) >= n, op, ": n must be in [1, ", q.size(2), "] (the queries' rows), got ", n);
  checks::check_keys(op, inputs.keys);
  const int64_t seq = inputs.keys.size(2);
  ObservedLayer layer;
  layer.inputs = inputs;
  layer.queries = q.narrow(2, q.size(2) - n, n);
  layer.query_positions = at::arange(seq - n, seq, at::TensorOptions().dtype(at::kLong));
  return layer;
}

SearchResult search_max_ratio(const std::vector<ObservedLayer>& layers,
                              const std::function<std::unique_ptr<BasePress>(double)>& make_press, double tolerance,
                              const SearchOptions& options) {
  constexpr const char* op = "search_max_ratio";
  TORCH_CHECK(!layers.empty(), op, ": layers must be non-empty");
  TORCH_CHECK(static_cast<bool>(make_press), op, ": make_press must be a function, got an empty one");
  std::vector<at::Tensor> full;
  for (const auto& layer : layers) full.push_back(full_output(layer));
  const auto quality = [&](double ratio) {
    if (ratio == 0.0) return 1.0;
    const std::unique_ptr<BasePress> press = make_press(ratio);
    TORCH_CHECK(press != nullptr, op, ": make_press(", ratio, ") must return a press, got nullptr");
    return quality_against(layers, full, *press);
  };
  return search_max_ratio(quality, tolerance, options);
}

double curve(double retention, double b) {
  TORCH_CHECK(retention >= 0.0 && retention <= 1.0, "curve: retention must be in [0, 1], got ", retention);
  TORCH_CHECK(std::isfinite(b), "curve: b must be finite, got ", b);
  if (std::abs(b) < 1e-9) return retention;
  // Two algebraically equal forms, each free of overflow on its side of 0.
  if (b > 0) return (std::exp(b * (retention - 1.0)) - std::exp(-b)) / -std::expm1(-b);
  return std::expm1(b * retention) / std::expm1(b);
}

double retention_for_target(double tau, double b) {
  TORCH_CHECK(tau >= 0.0 && tau <= 1.0, "retention_for_target: tau must be in [0, 1], got ", tau);
  TORCH_CHECK(std::isfinite(b), "retention_for_target: b must be finite, got ", b);
  double r;
  if (std::abs(b) < 1e-9) {
    r = tau;
  } else if (b > 0) {
    r = 1.0 + std::log(tau + (1.0 - tau) * std::exp(-b)) / b;
  } else {
    r = std::log1p(tau * std::expm1(b)) / b;
  }
  return std::clamp(r, 0.0, 1.0);
}

namespace {

double asymmetric_loss(const std::vector<CalibrationSample>& samples, double alpha, double beta, double over_weight) {
  double loss = 0.0;
  for (const auto& s : samples) {
    const double residual = curve(s.retention, alpha * s.context_nll + beta) - s.quality;
    loss += (residual > 0 ? over_weight : 1.0) * residual * residual;
  }
  return loss / static_cast<double>(samples.size());
}

// Plain Nelder–Mead on two parameters.
std::array<double, 3> nelder_mead(const std::function<double(double, double)>& f, double x0, double y0, double step,
                                  int max_iterations) {
  std::array<std::array<double, 3>, 3> s = {{{x0, y0, 0}, {x0 + step, y0, 0}, {x0, y0 + step, 0}}};
  for (auto& v : s) v[2] = f(v[0], v[1]);
  for (int it = 0; it < max_iterations; ++it) {
    std::sort(s.begin(), s.end(), [](const auto& a, const auto& b) { return a[2] < b[2]; });
    if (std::abs(s[2][2] - s[0][2]) < 1e-14 * (1 + std::abs(s[0][2])) &&
        std::abs(s[2][0] - s[0][0]) + std::abs(s[2][1] - s[0][1]) < 1e-10)
      break;
    const double cx = 0.5 * (s[0][0] + s[1][0]), cy = 0.5 * (s[0][1] + s[1][1]);
    auto at = [&](double t) {
      const double x = cx + t * (s[2][0] - cx), y = cy + t * (s[2][1] - cy);
      return std::array<double, 3>{x, y, f(x, y)};
    };
    const auto reflected = at(-1.0);
    if (reflected[2] < s[0][2]) {
      const auto expanded = at(-2.0);
      s[2] = expanded[2] < reflected[2] ? expanded : reflected;
    } else if (reflected[2] < s[1][2]) {
      s[2] = reflected;
    } else {
      const auto contracted = reflected[2] < s[2][2] ? at(-0.5) : at(0.5);
      if (contracted[2] < std::min(reflected[2], s[2][2])) {
        s[2] = contracted;
      } else {  // shrink towards the best vertex
        for (int i = 1; i < 3; ++i) {
          s[i][0] = 0.5 * (s[i][0] + s[0][0]);
          s[i][1] = 0.5 * (s[i][1] + s[0][1]);
          s[i][2] = f(s[i][0], s[i][1]);
        }
      }
    }
  }
  std::sort(s.begin(), s.end(), [](const auto& a, const auto& b) { return a[2] < b[2]; });
  return s[0];
}

}  // namespace

CalibrationFit fit_calibration(const std::vector<CalibrationSample>& samples, const FitOptions& options) {
  constexpr const char* op = "fit_calibration";
  TORCH_CHECK(samples.size() >= 2, op, ": samples must hold at least 2 samples, got ", samples.size());
  TORCH_CHECK(options.overestimate_weight > 0, op, ": overestimate_weight must be > 0, got ",
              options.overestimate_weight);
  for (const auto& s : samples) {
    TORCH_CHECK(s.retention > 0.0 && s.retention <= 1.0, op, ": retention must be in (0, 1], got ", s.retention);
    TORCH_CHECK(std::isfinite(s.context_nll) && std::isfinite(s.quality), op,
                ": context_nll and quality must be finite, got ", s.context_nll, " and ", s.quality);
  }
  const auto loss = [&](double a, double b) { return asymmetric_loss(samples, a, b, options.overestimate_weight); };
  CalibrationFit best;
  best.loss = std::numeric_limits<double>::infinity();
  // The loss is not convex in (alpha, beta): start from several shapes and keep the best.
  for (const auto& start :
       std::vector<std::array<double, 2>>{{0, 1}, {0, 5}, {1, 0}, {-1, 5}, {2, 2}, {0, 15}, {5, -5}}) {
    const auto found = nelder_mead(loss, start[0], start[1], 1.0, options.max_iterations);
    if (found[2] < best.loss) best = CalibrationFit{found[0], found[1], found[2]};
  }
  return best;
}

}  // namespace kvpress::calibration
