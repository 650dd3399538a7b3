// DMSPress: threshold eviction behind a sliding window, at prefill and while decoding (see
// include/kvpress/presses/dms_press.h and docs/PRESS_NOTES.md).
#include "kvpress/presses/dms_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

#include "checks.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr const char* kName = "DMSPress";

}  // namespace

DMSPress::DMSPress(std::shared_ptr<const ScorerPress> press, std::optional<double> threshold,
                   int64_t sliding_window_size, bool decoding)
    : HeadRaggedWrapperPress(std::move(press), kName),
      threshold_(threshold),
      window_(sliding_window_size),
      decoding_(decoding) {
  check_params("DMSPress", Params{threshold, sliding_window_size, decoding});
}

double DMSPress::threshold_or_raise(const char* op) const {
  TORCH_CHECK(threshold_.has_value(), op,
              ": threshold must be set (kvpress's default None cannot be compared with scores; the right value "
              "depends on the inner press), got None");
  return *threshold_;
}

at::Tensor DMSPress::scores_of(const LayerInputs& inputs, const char* op) const {
  return inner_scores(without_attentions(inputs), op);  // kvpress hands its scorer no attention weights
}

at::Tensor DMSPress::judge_prefill(const LayerInputs& inputs, at::Tensor* window_scores) const {
  constexpr const char* op = "DMSPress.keep_mask";
  const double threshold = threshold_or_raise(op);
  checks::check_kv(op, inputs.keys, inputs.values);
  const at::Tensor scores = scores_of(inputs, op);  // [B, Hkv, S]
  const int64_t s = scores.size(2), judged = std::max<int64_t>(0, s - window_);
  at::Tensor keep = at::ones(scores.sizes(), scores.options().dtype(at::kBool));
  keep.narrow(2, 0, judged).copy_(scores.narrow(2, 0, judged).ge(threshold));  // finite: inner_scores checks
  if (window_scores) *window_scores = scores.narrow(2, judged, s - judged).contiguous();
  return keep;
}

at::Tensor DMSPress::keep_mask(const LayerInputs& inputs) const { return judge_prefill(inputs, nullptr); }

at::Tensor DMSPress::prefill_window(const LayerInputs& inputs, DMSWindow& window) const {
  TORCH_CHECK(inputs.layer_idx >= 0, "DMSPress.prefill_window: layer_idx must be >= 0, got ", inputs.layer_idx);
  auto& slots = window.scores;
  if (static_cast<int64_t>(slots.size()) <= inputs.layer_idx) slots.resize(static_cast<size_t>(inputs.layer_idx) + 1);
  return judge_prefill(inputs, &slots[static_cast<size_t>(inputs.layer_idx)]);
}

DMSEviction DMSPress::decoding_step(const LayerInputs& forward, int64_t tokens_seen, DMSWindow& window) const {
  constexpr const char* op = "DMSPress.decoding_step";
  const double threshold = threshold_or_raise(op);
  checks::check_kv(op, forward.keys, forward.values);
  checks::check_defined(op, "hidden_states", forward.hidden_states);
  const int64_t n = forward.hidden_states.size(1);
  TORCH_CHECK(n >= 1 && n <= forward.keys.size(2), op,
              ": hidden_states must hold the forward's n new tokens (1 <= n <= ", forward.keys.size(2),
              ", the cached tokens), got ", n);
  TORCH_CHECK(forward.layer_idx >= 0, op, ": layer_idx must be >= 0, got ", forward.layer_idx);
  // The new tokens alone, as kvpress scores them (keys[-n:], values[-n:], the forward's inputs).
  LayerInputs fresh = forward;
  fresh.keys = forward.keys.narrow(2, forward.keys.size(2) - n, n);
  fresh.values = forward.values.narrow(2, forward.values.size(2) - n, n);
  fresh.queries = at::Tensor();
  const at::Tensor scores = scores_of(fresh, op);  // [B, Hkv, n]

  auto& slots = window.scores;
  if (static_cast<int64_t>(slots.size()) <= forward.layer_idx) slots.resize(static_cast<size_t>(forward.layer_idx) + 1);
  at::Tensor& queue = slots[static_cast<size_t>(forward.layer_idx)];
  queue = queue.defined() ? at::cat({queue, scores}, 2) : scores;
  DMSEviction out;
  const int64_t queued = queue.size(2), leaving = std::max<int64_t>(0, queued - window_);
  TORCH_CHECK(tokens_seen >= queued, op, ": tokens_seen (", tokens_seen, ") must be at least the ", queued,
              " tokens the window holds");
  out.first = tokens_seen - queued;
  out.evict = queue.narrow(2, 0, leaving).lt(threshold);
  queue = queue.narrow(2, leaving, queued - leaving).contiguous();
  return out;
}

std::unique_ptr<PressSequenceState> DMSPress::new_sequence_state() const {
  return decoding_ ? std::make_unique<DMSWindow>() : nullptr;
}

at::Tensor DMSPress::record_prefill(const LayerInputs& inputs, PressSequenceState& state) const {
  return prefill_window(inputs, own_sequence_state<DMSWindow>(state, *this));
}

DecodingRole DMSPress::decoding_role() const {
  DecodingRole role;
  role.compresses = decoding_;
  role.evicts_per_head = true;  // the inner scorer gets no attention weights (scorer stays nullptr)
  return role;
}

DecodingUpdate DMSPress::decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                         PressSequenceState& state) const {
  DMSEviction e = decoding_step(forward, tokens_seen, own_sequence_state<DMSWindow>(state, *this));
  DecodingUpdate update;
  if (e.evict.numel() > 0 && e.evict.any().item<bool>()) {
    update.kind = DecodingUpdate::Kind::kEvict;
    update.evict_first = e.first;
    update.evict = std::move(e.evict);
  }
  return update;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "DMSPress",
      PressKind::kWrapper,
      "tokens leaving a sliding window evicted per head where the inner score is below a threshold (prefill, and "
      "with decoding=true while generating; head-ragged)",
      {{}, {}, {}, "the inner press gets no attention weights (kvpress passes none)"},
      [](double, ParamReader& p) {
        auto inner = inner_scorer(p, 0.0);
        DMSPress::Params params;
        p.read_all(params);
        return std::make_unique<DMSPress>(std::move(inner), params.threshold, params.sliding_window_size,
                                          params.decoding);
      },
      "the threshold and the content set how much is evicted"};
});

}  // namespace

}  // namespace kvpress
