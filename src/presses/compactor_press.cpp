#include "kvpress/presses/compactor_press.h"

#include <cmath>
#include <memory>

#include "checks.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

// CompactorPress's two scorers, after checking its parameters under its own name. The scorers'
// own compression ratio is never used: only their score() is called.
std::vector<std::shared_ptr<const ScorerPress>> compactor_scorers(int64_t sink_size_start, int64_t sink_size_end,
                                                                  int64_t chunk_size, int64_t sketch_dimension,
                                                                  std::optional<double> blending,
                                                                  std::optional<int64_t> seed) {
  constexpr const char* op = "CompactorPress";
  checks::check_non_negative(op, "sink_size_start", sink_size_start);
  checks::check_non_negative(op, "sink_size_end", sink_size_end);
  checks::check_positive(op, "chunk_size", chunk_size);
  checks::check_positive(op, "sketch_dimension", sketch_dimension);
  if (blending) TORCH_CHECK(std::isfinite(*blending), op, ": blending must be finite, got ", *blending);
  if (seed) checks::check_non_negative(op, "seed", *seed);
  return {std::make_shared<LeverageScorePress>(0.0, sketch_dimension, seed),
          std::make_shared<NonCausalAttnPress>(0.0, chunk_size)};
}

}  // namespace

CompactorPress::CompactorPress(double compression_ratio, int64_t sink_size_start, int64_t sink_size_end,
                               int64_t chunk_size, int64_t sketch_dimension, std::optional<double> blending,
                               std::optional<int64_t> seed, TokenSelection selection)
    : ScoreBlendPress(compression_ratio,
                      compactor_scorers(sink_size_start, sink_size_end, chunk_size, sketch_dimension, blending, seed),
                      {0.0, 1.0},
                      // Both scorers already return z-scores; kvpress sums them as they are.
                      ScoreBlendOptions{sink_size_start, sink_size_end, /*normalize=*/false, selection}),
      chunk_size_(chunk_size),
      sketch_dimension_(sketch_dimension),
      blending_(blending),
      seed_(seed) {}

std::vector<double> CompactorPress::weights() const { return {blending_.value_or(compression_ratio()), 1.0}; }

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "CompactorPress",
      PressKind::kScorer,
      "blending * z(leverage) + z(non-causal attention), sinks kept",
      {{{{"queries", "cos", "sin"}, true}, {{"hidden_states", "q_proj", "cos", "sin"}}}},
      [](double r, ParamReader& p) {
        const int64_t start =
            p.get("sink_size_start", CompactorPress::kDefaultSinkSizeStart, "first tokens always kept");
        const int64_t end = p.get("sink_size_end", CompactorPress::kDefaultSinkSizeEnd, "last tokens always kept");
        const int64_t chunk =
            p.get("chunk_size", CompactorPress::kDefaultChunkSize, "positions per non-causal attention chunk");
        const int64_t sketch =
            p.get("sketch_dimension", CompactorPress::kDefaultSketchDimension, "columns of the leverage sketch");
        const auto blending =
            p.get_optional_double("blending", "weight of the leverage scores; None = compression_ratio (paper: 0.3)");
        const auto seed = p.get_optional_int("seed", "seed of the leverage sketch's CPU generator");
        const std::string selection = p.get_choice(
            "selection", {"per_head", "across_heads"},
            "per_head (kvpress) or across_heads (the paper's global top-k; head budgets vary, head-ragged)");
        return std::make_unique<CompactorPress>(
            r, start, end, chunk, sketch, blending, seed,
            selection == "per_head" ? TokenSelection::kPerHead : TokenSelection::kAcrossHeads);
      }};
});

}  // namespace

}  // namespace kvpress
