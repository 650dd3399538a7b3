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

CompactorPress::CompactorPress(double compression_ratio, const Params& params)
    : CompactorPress(compression_ratio, params.sink_size_start, params.sink_size_end, params.chunk_size,
                     params.sketch_dimension, params.blending, params.seed, params.selection) {}

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
      seed_(seed) {
  check_params("CompactorPress",
               Params{sink_size_start, sink_size_end, chunk_size, sketch_dimension, blending, seed, selection});
}

std::vector<double> CompactorPress::weights() const { return {blending_.value_or(compression_ratio()), 1.0}; }

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"CompactorPress",
                    PressKind::kScorer,
                    "blending * z(leverage) + z(non-causal attention), sinks kept",
                    {{{{"queries", "cos", "sin"}, true}, {{"hidden_states", "q_proj", "cos", "sin"}}}},
                    from_params<CompactorPress>};
});

}  // namespace

}  // namespace kvpress
