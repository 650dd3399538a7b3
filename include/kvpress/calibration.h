// Calibrated compression: how far can this context be compressed before quality drops?
//
// Two tools:
//  * search_max_ratio: for one context, search the largest compression ratio whose quality stays
//    within a tolerance, against any quality function (default: model-free attention-output
//    error of the observation queries, see attention_output_quality).
//  * The context-calibrated curve of Compactor (Chari & Van Durme, arXiv 2507.08143):
//      f(r) = (exp(b·r − b) − exp(−b)) / (1 − exp(−b)),   b = α·NLL(context) + β,
//    where r is the RETAINED fraction (1 − compression ratio) and f the quality ratio
//    (full-cache answer NLL / compressed-cache answer NLL, 1 = no loss). fit_calibration fits
//    (α, β) from samples with an asymmetric loss; predict_retention inverts f in closed form.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kvpress/presses/base_press.h"
#include "kvpress/types.h"

namespace kvpress::calibration {

// ---- quality of a compressed cache (model-free) ------------------------------------------

// Attention output of `queries` at `query_positions` over keys/values at `key_positions`,
// causal by original position (a query sees keys at positions <= its own), GQA by head groups,
// float32. A query that sees no key outputs zeros.
at::Tensor attention_output(const at::Tensor& queries,          // [B, Hq, n, D] post-RoPE
                            const at::Tensor& query_positions,  // [n] int64
                            const at::Tensor& keys,             // [B, Hkv, m, D]
                            const at::Tensor& values,           // [B, Hkv, m, D]
                            const at::Tensor& key_positions);   // [B, Hkv, m] or [m] int64
                                                                // -> [B, Hq, n, D] float32

// One layer's full cache and the observation queries that judge a compression of it.
struct ObservedLayer {
  LayerInputs inputs;          // what a press needs (keys, values, queries/attentions/...)
  at::Tensor queries;          // [B, Hq, n, D] post-RoPE observation queries
  at::Tensor query_positions;  // [n] int64, usually the last n positions
};

// The observation queries calibration uses by default: a layer's last 16 positions.
constexpr int64_t kDefaultObservedQueries = 16;

// `inputs` observed by its last `n` queries (inputs.queries [B, Hq, S, D] post-RoPE, every position
// of the layer's S keys). Raises c10::Error "observe_last: ..." unless inputs.queries holds at least
// n >= 1 rows.
ObservedLayer observe_last(const LayerInputs& inputs, int64_t n = kDefaultObservedQueries);

// Compresses every layer with `press` and returns 1 − E, E = ||O_c − O_f||_F / ||O_f||_F with
// the attention outputs of all layers stacked (so layers weigh by their output energy).
// 1 means "no change"; it can go below 0 for a destroyed cache.
double attention_output_quality(const std::vector<ObservedLayer>& layers, const BasePress& press);

// ---- search of the largest ratio that keeps quality -----------------------------------------

// A compression ratio -> quality function (higher is better).
using QualityFn = std::function<double(double compression_ratio)>;

struct SearchOptions {
  double max_ratio = 0.95;   // never return more than this
  int grid_points = 8;       // coarse scan: ratios max_ratio * i / grid_points, i = 1..grid_points
  double resolution = 1e-3;  // bisection stops when the bracket is narrower than this
  int max_evaluations = 40;  // hard cap on quality evaluations
};

struct SearchResult {
  double ratio = 0.0;    // largest accepted ratio (0 when even the first grid point fails)
  double quality = 0.0;  // quality at `ratio`
  std::vector<std::pair<double, double>> evaluations;  // (ratio, quality) in evaluation order
};

// Finds the largest ratio in [0, max_ratio] with quality(ratio) >= quality(0) − tolerance.
// What is guaranteed, with no assumption of monotonicity:
//   * the returned ratio itself passed, and so did every grid point below it (so the answer
//     never sits on an isolated lucky island above a failure);
//   * it lies within `resolution` of a failing ratio, or equals max_ratio;
//   * at most max_evaluations calls of `quality`.
// A non-monotone curve can have passing ratios above the first failure; they are not reported
// (the search is conservative: it stops at the first failing grid point and bisects below it).
SearchResult search_max_ratio(const QualityFn& quality, double tolerance, const SearchOptions& options = {});

// Convenience: default quality (attention_output_quality) of presses built by `make_press`.
SearchResult search_max_ratio(const std::vector<ObservedLayer>& layers,
                              const std::function<std::unique_ptr<BasePress>(double)>& make_press, double tolerance,
                              const SearchOptions& options = {});

// ---- the context-calibrated curve -----------------------------------------------------------

// f(r) for retention r in [0, 1] and shape b (b -> 0 gives f(r) = r).
double curve(double retention, double b);

// Smallest retention r with f(r) >= tau: r* = 1 + ln(tau + (1 − tau)·e^{−b}) / b.
double retention_for_target(double tau, double b);

struct CalibrationSample {
  double retention;    // 1 − compression ratio, in (0, 1]
  double context_nll;  // the model's mean NLL on the context (nats/token)
  double quality;      // quality ratio in [0, 1], e.g. full NLL / compressed NLL of the answer
};

struct CalibrationFit {
  double alpha = 0.0;
  double beta = 0.0;
  double loss = 0.0;  // asymmetric loss at the optimum
  double b(double context_nll) const { return alpha * context_nll + beta; }
  // Retention predicted for a context with this NLL to reach quality tau.
  double predict_retention(double context_nll, double tau) const { return retention_for_target(tau, b(context_nll)); }
};

struct FitOptions {
  // Weight of a residual where the curve over-estimates quality (f > y): that direction
  // under-estimates the retention a context needs, the costly mistake.
  double overestimate_weight = 4.0;
  int max_iterations = 2000;
};

// Least squares with the asymmetric weights, minimised by Nelder–Mead from several starts.
CalibrationFit fit_calibration(const std::vector<CalibrationSample>& samples, const FitOptions& options = {});

}  // namespace kvpress::calibration
