// LeverageScorePress, NonCausalAttnPress, ScoreBlendPress and CompactorPress.
#include <ATen/ATen.h>

#include <cmath>

#include "checks.h"
#include "kvpress/ops.h"
#include "kvpress/presses/compactor_press.h"
#include "kvpress/presses/leverage_score_press.h"
#include "kvpress/presses/non_causal_attn_press.h"
#include "kvpress/presses/score_blend_press.h"

namespace kvpress {
namespace {

// The inputs restricted to positions [begin, end): what a scorer of a blended press sees between
// the sinks. Queries / attention rows cover the last q_len positions; only those inside the range
// are kept (none left: the tensor is dropped). Attention columns are cut, not renormalised.
LayerInputs slice_positions(const LayerInputs& in, int64_t begin, int64_t end) {
  const int64_t seq = in.keys.size(2), len = end - begin;
  LayerInputs out = in;
  out.keys = in.keys.narrow(2, begin, len);
  out.values = in.values.narrow(2, begin, len);
  if (in.hidden_states.defined() && in.hidden_states.dim() == 3 && in.hidden_states.size(1) == seq)
    out.hidden_states = in.hidden_states.narrow(1, begin, len);
  if (in.cos.defined() && in.cos.dim() == 2 && in.cos.size(0) == seq) out.cos = in.cos.narrow(0, begin, len);
  if (in.sin.defined() && in.sin.dim() == 2 && in.sin.size(0) == seq) out.sin = in.sin.narrow(0, begin, len);
  // Rows of the last q_len positions that fall in [begin, end).
  auto rows = [&](const at::Tensor& t) -> at::Tensor {
    const int64_t q_len = t.size(2), first = seq - q_len;
    const int64_t lo = std::max(begin, first);
    if (lo >= end) return at::Tensor();
    return t.narrow(2, lo - first, end - lo);
  };
  if (in.queries.defined() && in.queries.dim() == 4 && in.queries.size(2) <= seq) out.queries = rows(in.queries);
  if (in.attentions.defined() && in.attentions.dim() == 4 && in.attentions.size(2) <= seq &&
      in.attentions.size(3) == seq) {
    out.attentions = rows(in.attentions);
    if (out.attentions.defined()) out.attentions = out.attentions.narrow(3, begin, len);
  }
  if (out.num_heads == 0) {
    // Keep the head count known even if the tensor it was inferred from was dropped.
    try {
      out.num_heads = ops::num_query_heads(in);
    } catch (const c10::Error&) {
    }
  }
  return out;
}

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

// ---- LeverageScorePress --------------------------------------------------------------------

LeverageScorePress::LeverageScorePress(double compression_ratio, int64_t sketch_dimension,
                                       std::optional<int64_t> seed)
    : ScorerPress(compression_ratio), sketch_dimension_(sketch_dimension), seed_(seed) {
  checks::check_positive("LeverageScorePress", "sketch_dimension", sketch_dimension);
  if (seed) checks::check_non_negative("LeverageScorePress", "seed", *seed);
}

at::Tensor LeverageScorePress::score(const LayerInputs& inputs) const {
  constexpr const char* op = "LeverageScorePress";
  checks::check_kv(op, inputs.keys, inputs.values);
  return ops::zscore(ops::leverage_scores(inputs, sketch_dimension_, seed_.value_or(-1), op));
}

// ---- NonCausalAttnPress --------------------------------------------------------------------

NonCausalAttnPress::NonCausalAttnPress(double compression_ratio, int64_t chunk_size)
    : ScorerPress(compression_ratio), chunk_size_(chunk_size) {
  checks::check_positive("NonCausalAttnPress", "chunk_size", chunk_size);
}

at::Tensor NonCausalAttnPress::score(const LayerInputs& inputs) const {
  constexpr const char* op = "NonCausalAttnPress";
  checks::check_kv(op, inputs.keys, inputs.values);
  const at::Tensor sums = ops::noncausal_column_sums(inputs, chunk_size_, op);
  return ops::noncausal_attention_scores(sums, inputs.values);
}

// ---- ScoreBlendPress -----------------------------------------------------------------------

ScoreBlendPress::ScoreBlendPress(double compression_ratio, std::vector<std::shared_ptr<const ScorerPress>> scorers,
                                 std::vector<double> weights, ScoreBlendOptions options)
    : ScorerPress(compression_ratio), scorers_(std::move(scorers)), weights_(std::move(weights)), options_(options) {
  constexpr const char* op = "ScoreBlendPress";
  TORCH_CHECK(!scorers_.empty(), op, ": scorers must hold at least one press, got none");
  for (const auto& s : scorers_) TORCH_CHECK(s != nullptr, op, ": scorers must not hold a null press");
  TORCH_CHECK(weights_.size() == scorers_.size(), op, ": weights must hold one weight per scorer (",
              scorers_.size(), "), got ", weights_.size());
  for (double w : weights_) TORCH_CHECK(std::isfinite(w), op, ": weights must be finite, got ", w);
  checks::check_non_negative(op, "sink_size_start", options_.sink_size_start);
  checks::check_non_negative(op, "sink_size_end", options_.sink_size_end);
}

at::Tensor ScoreBlendPress::score(const LayerInputs& inputs) const {
  const std::string op = name();
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  // kvpress: left = min(start, S), right = min(end, max(0, S - left)).
  const int64_t left = std::min(options_.sink_size_start, seq);
  const int64_t right = std::min(options_.sink_size_end, std::max<int64_t>(0, seq - left));
  const int64_t inner = seq - left - right;
  const auto f32 = inputs.keys.options().dtype(at::kFloat);
  if (inner == 0) return at::ones({batch, kv_heads, seq}, f32);  // every position is a sink

  const LayerInputs sliced = (left == 0 && right == 0) ? inputs : slice_positions(inputs, left, left + inner);
  std::vector<at::Tensor> parts;
  for (const auto& scorer : scorers_) {
    at::Tensor s = scorer->score(sliced);
    TORCH_CHECK(s.dim() == 3 && s.size(0) == batch && s.size(1) == kv_heads && s.size(2) == inner, op, ": ",
                scorer->name(), " returned scores of shape ", checks::shape_str(s), ", expected [", batch, ", ",
                kv_heads, ", ", inner, "]");
    parts.push_back(std::move(s));
  }
  const std::vector<double> w = weights();
  TORCH_CHECK(w.size() == parts.size(), op, ": weights must hold one weight per scorer (", parts.size(), "), got ",
              w.size());
  const at::Tensor blended = ops::blend_scores(parts, w, options_.normalize);
  if (left == 0 && right == 0) return blended;
  // Sinks get the maximum (not max + 1), as kvpress pads them.
  const double top = blended.max().item<double>();
  return at::cat({at::full({batch, kv_heads, left}, top, f32), blended, at::full({batch, kv_heads, right}, top, f32)},
                 -1);
}

KV ScoreBlendPress::compress(const LayerInputs& inputs) const {
  TORCH_CHECK(options_.selection == TokenSelection::kPerHead, name(),
              ".compress: selection across_heads keeps a different number of tokens per KV head, which KV "
              "cannot hold; use compress_ragged() or keep_mask()");
  return ScorerPress::compress(inputs);
}

at::Tensor ScoreBlendPress::keep_mask(const LayerInputs& inputs) const {
  const std::string op = name() + ".keep_mask";
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  const int64_t batch = inputs.keys.size(0), kv_heads = inputs.keys.size(1), seq = inputs.keys.size(2);
  const auto bool_opts = inputs.keys.options().dtype(at::kBool);
  if (compression_ratio() == 0.0) return at::ones({batch, kv_heads, seq}, bool_opts);
  const at::Tensor scores = score(inputs);
  checks::check_finite_scores(op.c_str(), scores);
  const int64_t n_kept = ops::n_kept(seq, compression_ratio());
  if (options_.selection == TokenSelection::kAcrossHeads) return ops::topk_mask_across_heads(scores, kv_heads * n_kept);
  at::Tensor mask = at::zeros({batch, kv_heads, seq}, bool_opts);
  mask.scatter_(2, ops::topk_indices(scores, n_kept), true);
  return mask;
}

RaggedKV ScoreBlendPress::compress_ragged(const LayerInputs& inputs) const {
  return ops::gather_ragged(inputs.keys, inputs.values, keep_mask(inputs));
}

// ---- CompactorPress ------------------------------------------------------------------------

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

}  // namespace kvpress
