// Calibrated-ratio search and the context-calibrated curve, on synthetic cases with known answers.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kvpress/calibration.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace kvpress::calibration {
namespace {

using kvpress::testing::expect_error;
using kvpress::testing::randn;

TEST(Curve, RunsFromZeroToOneAndIsMonotone) {
  for (double b : {-8.0, -1.0, 0.0, 1e-12, 0.5, 3.0, 12.0, 60.0}) {
    SCOPED_TRACE(b);
    EXPECT_NEAR(curve(0.0, b), 0.0, 1e-12);
    EXPECT_NEAR(curve(1.0, b), 1.0, 1e-12);
    for (double r = 0.05; r <= 1.0; r += 0.05) EXPECT_GE(curve(r, b), curve(r - 0.05, b));
  }
  EXPECT_NEAR(curve(0.3, 0.0), 0.3, 1e-12);  // b -> 0 is the identity
  // Larger b: quality only recovers close to full retention, so more retention is needed.
  EXPECT_LT(curve(0.3, 8.0), curve(0.3, 1.0));
  EXPECT_GT(retention_for_target(0.9, 8.0), retention_for_target(0.9, 1.0));
}

TEST(Curve, RetentionForTargetInvertsTheCurve) {
  for (double b : {-5.0, -0.5, 0.0, 0.7, 4.0, 20.0})
    for (double tau : {0.5, 0.9, 0.95, 0.99}) {
      SCOPED_TRACE(std::to_string(b) + " " + std::to_string(tau));
      const double r = retention_for_target(tau, b);
      EXPECT_NEAR(curve(r, b), tau, 1e-9);
    }
  EXPECT_DOUBLE_EQ(retention_for_target(1.0, 3.0), 1.0);
  EXPECT_DOUBLE_EQ(retention_for_target(0.0, 3.0), 0.0);
}

std::vector<CalibrationSample> samples_from(double alpha, double beta, double noise = 0.0) {
  std::vector<CalibrationSample> out;
  at::manual_seed(0);
  const at::Tensor eps = at::randn({200}, at::kDouble) * noise;
  int i = 0;
  for (double nll : {0.8, 1.2, 1.6, 2.1, 2.7})
    for (double r = 0.1; r <= 1.0001; r += 0.1) {
      const double y = curve(r, alpha * nll + beta) + eps[i++].item<double>();
      out.push_back({r, nll, y});
    }
  return out;
}

TEST(Fit, RecoversKnownParametersFromExactSamples) {
  const CalibrationFit fit = fit_calibration(samples_from(2.5, 1.0));
  EXPECT_NEAR(fit.alpha, 2.5, 1e-3);
  EXPECT_NEAR(fit.beta, 1.0, 1e-3);
  EXPECT_LT(fit.loss, 1e-10);
  // The prediction for a new context reaches the target on the true curve.
  const double r = fit.predict_retention(1.9, 0.95);
  EXPECT_NEAR(curve(r, 2.5 * 1.9 + 1.0), 0.95, 1e-3);
}

TEST(Fit, AsymmetricLossPrefersUnderEstimatingQuality) {
  const auto noisy = samples_from(2.0, 0.5, 0.03);
  FitOptions symmetric;
  symmetric.overestimate_weight = 1.0;
  FitOptions cautious;
  cautious.overestimate_weight = 10.0;
  auto overestimates = [&](const CalibrationFit& fit) {
    int n = 0;
    for (const auto& s : noisy) n += curve(s.retention, fit.b(s.context_nll)) > s.quality;
    return n;
  };
  const CalibrationFit a = fit_calibration(noisy, symmetric), c = fit_calibration(noisy, cautious);
  EXPECT_LT(overestimates(c), overestimates(a));
  // ... so it asks for more retention for the same target.
  EXPECT_GT(c.predict_retention(1.5, 0.95), a.predict_retention(1.5, 0.95));
}

TEST(Search, FindsTheThresholdOfAMonotoneCurve) {
  // quality = 1 - r^2, tolerance 0.25 -> largest ratio 0.5.
  int calls = 0;
  const SearchResult res = search_max_ratio(
      [&](double r) {
        ++calls;
        return 1.0 - r * r;
      },
      0.25);
  EXPECT_NEAR(res.ratio, 0.5, 1e-3);
  EXPECT_LE(res.ratio, 0.5);
  EXPECT_GE(res.quality, 0.75);
  EXPECT_EQ(calls, static_cast<int>(res.evaluations.size()));
  EXPECT_LE(calls, SearchOptions{}.max_evaluations);
}

TEST(Search, StopsBelowTheFirstFailureOfANonMonotoneCurve) {
  // Passes on [0, 0.3], fails on (0.3, 0.5), passes again above: the answer is 0.3, not 0.95.
  const auto quality = [](double r) { return (r > 0.3 && r < 0.5) ? 0.0 : 1.0; };
  const SearchResult res = search_max_ratio(quality, 0.1);
  EXPECT_NEAR(res.ratio, 0.3, 1e-3);
  EXPECT_LE(res.ratio, 0.3);
  for (const auto& [r, q] : res.evaluations)
    if (r <= res.ratio) EXPECT_EQ(q, 1.0) << "a ratio below the answer failed: " << r;
}

TEST(Search, ReturnsMaxRatioWhenEverythingPassesAndZeroWhenNothingDoes) {
  SearchOptions options;
  options.max_ratio = 0.9;
  EXPECT_DOUBLE_EQ(search_max_ratio([](double) { return 1.0; }, 0.0, options).ratio, 0.9);
  const SearchResult none = search_max_ratio([](double r) { return r == 0.0 ? 1.0 : 0.0; }, 0.1, options);
  EXPECT_LT(none.ratio, options.resolution);
}

TEST(Search, Validation) {
  expect_error([] { search_max_ratio([](double) { return 1.0; }, -0.1); },
               {"search_max_ratio: tolerance must be >= 0, got -0.1"});
  SearchOptions bad;
  bad.max_ratio = 1.0;
  expect_error([&] { search_max_ratio([](double) { return 1.0; }, 0.1, bad); }, {"max_ratio must be in (0, 1), got 1"});
  expect_error([] { search_max_ratio([](double) { return std::nan(""); }, 0.1); },
               {"search_max_ratio: quality(0) is NaN"});
  expect_error(
      [] {
        fit_calibration({{0.5, 1.0, 0.9}});
      },
      {"fit_calibration: samples must hold at least 2 samples, got 1"});
  expect_error([] { retention_for_target(1.5, 1.0); }, {"retention_for_target: tau must be in [0, 1], got 1.5"});
}

ObservedLayer random_observed_layer(uint64_t seed) {
  ObservedLayer layer;
  layer.inputs.keys = randn({1, 2, 128, 16}, seed);
  layer.inputs.values = randn({1, 2, 128, 16}, seed + 1);
  layer.queries = randn({1, 4, 8, 16}, seed + 2);
  layer.query_positions = at::arange(120, 128);
  layer.inputs.queries = layer.queries;
  return layer;
}

TEST(AttentionQuality, IsOneForAnUncompressedCacheAndFallsWithCompression) {
  const std::vector<ObservedLayer> layers = {random_observed_layer(1), random_observed_layer(5)};
  EXPECT_DOUBLE_EQ(attention_output_quality(layers, KnormPress(0.0)), 1.0);
  const double q25 = attention_output_quality(layers, KnormPress(0.25));
  const double q90 = attention_output_quality(layers, KnormPress(0.9));
  EXPECT_LT(q25, 1.0);
  EXPECT_LT(q90, q25);
}

TEST(AttentionQuality, SearchResultKeepsQualityWithinTolerance) {
  const std::vector<ObservedLayer> layers = {random_observed_layer(9)};
  const auto make = [](double r) { return make_press("SnapKVPress", r, {{"window_size", "8"}}); };
  const SearchResult res = search_max_ratio(layers, make, 0.1);
  EXPECT_GT(res.ratio, 0.0);
  EXPECT_GE(attention_output_quality(layers, *make(res.ratio)), 1.0 - 0.1);
}

TEST(AttentionOutput, MatchesSoftmaxOverVisibleKeys) {
  const at::Tensor q = randn({1, 2, 1, 4}, 20), k = randn({1, 1, 3, 4}, 21), v = randn({1, 1, 3, 4}, 22);
  // Query at position 1 sees keys at positions 0 and 1 only.
  const at::Tensor out = attention_output(q, at::tensor({1L}), k, v, at::arange(3));
  const at::Tensor w = at::softmax(at::matmul(q[0][0], k[0][0].narrow(0, 0, 2).t()) / 2.0, -1);
  EXPECT_TRUE(at::allclose(out[0][0], at::matmul(w, v[0][0].narrow(0, 0, 2)), 1e-5, 1e-6));
}

}  // namespace
}  // namespace kvpress::calibration
