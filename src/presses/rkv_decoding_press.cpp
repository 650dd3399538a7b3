// RKVDecodingPress: R-KV's budgeted compression while generating (docs/PRESS_NOTES.md, "RKVPress").
#include "kvpress/presses/rkv_decoding_press.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "layer_slices.h"
#include "presses/registration.h"

namespace kvpress {

namespace {

constexpr const char* kOp = "RKVDecodingPress";

// The inputs' last min(window, query rows, S) queries, float32 [B, Hq, w, D].
at::Tensor last_queries(const LayerInputs& in, int64_t window, const char* op) {
  return ops::window_queries(in, clamped_window(in, window), op).to(at::kFloat);
}

}  // namespace

RKVDecodingPress::RKVDecodingPress(const Params& params) : params_(params), scorer_(0.0, params) {
  check_params(kOp, params_);
  TORCH_CHECK(params_.budget > params_.window_size, kOp, ": budget must be > window_size (", params_.window_size,
              "), got ", params_.budget);
}

RKVDecodingPress::RKVDecodingPress() : RKVDecodingPress(Params{}) {}

KV RKVDecodingPress::keep_budget(const LayerInputs& in) const {
  if (in.keys.size(2) < params_.budget) return budget::keep_all(in);
  return ops::gather_kv(in.keys, in.values, ops::topk_indices(scorer_.score(in), params_.budget));
}

KV RKVDecodingPress::compress(const LayerInputs& in) const {
  checks::check_kv(kOp, in.keys, in.values);
  return keep_budget(in);
}

bool RKVDecodingPress::due(int64_t n, int64_t tokens_seen) const {
  const int64_t before = tokens_seen - n;  // the length the previous forward left
  return before > 0 && before % params_.divide_length == 0;
}

std::unique_ptr<PressSequenceState> RKVDecodingPress::new_sequence_state() const {
  return std::make_unique<RKVQueryWindow>();
}

at::Tensor RKVDecodingPress::record_prefill(const LayerInputs& in, PressSequenceState& state) const {
  const std::string op = std::string(kOp) + ".record_prefill";
  checks::check_kv(op.c_str(), in.keys, in.values);
  TORCH_CHECK(in.layer_idx >= 0, op, ": layer_idx must be >= 0, got ", in.layer_idx);
  RKVQueryWindow& window = own_sequence_state<RKVQueryWindow>(state, *this);
  const auto layer = static_cast<size_t>(in.layer_idx);
  if (window.queries.size() <= layer) window.queries.resize(layer + 1);
  window.queries[layer] = last_queries(in, params_.window_size, op.c_str());
  return at::Tensor();  // the engine compresses with compress(), as for any press
}

DecodingRole RKVDecodingPress::decoding_role() const {
  DecodingRole role;
  role.compresses = true;
  role.records_prefill = true;
  return role;
}

bool RKVDecodingPress::decoding_reads_cache(int64_t /*layer*/, int64_t n, int64_t tokens_seen,
                                            const PressSequenceState& /*state*/) const {
  return due(n, tokens_seen);
}

DecodingUpdate RKVDecodingPress::decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                                 PressSequenceState& state) const {
  const std::string op_name = std::string(kOp) + ".decoding_update";
  const char* op = op_name.c_str();
  TORCH_CHECK(forward.hidden_states.defined(), op, ": needs hidden_states (the forward's attention input), got none");
  checks::check_rank(op, "hidden_states", forward.hidden_states, 3, "[batch, n, hidden]");
  TORCH_CHECK(forward.layer_idx >= 0, op, ": layer_idx must be >= 0, got ", forward.layer_idx);
  const int64_t n = forward.hidden_states.size(1);
  TORCH_CHECK(tokens_seen >= n, op, ": tokens_seen must be >= the forward's ", n, " tokens, got ", tokens_seen);
  RKVQueryWindow& window = own_sequence_state<RKVQueryWindow>(state, *this);
  const auto layer = static_cast<size_t>(forward.layer_idx);
  if (window.queries.size() <= layer) window.queries.resize(layer + 1);
  // This forward's queries, each at its own position (the forward's cos/sin rows [n, D]).
  TORCH_CHECK(forward.cos.defined() && forward.sin.defined() && forward.cos.dim() == 2 && forward.cos.size(0) == n &&
                  forward.sin.sizes() == forward.cos.sizes(),
              op, ": cos and sin must be the forward's RoPE rows [", n, ", head_dim], got ",
              checks::shape_str(forward.cos), " and ", checks::shape_str(forward.sin));
  const at::Tensor fresh = ops::apply_rope(ops::project_queries(forward.hidden_states, forward, op),
                                           forward.cos.to(at::kFloat), forward.sin.to(at::kFloat));  // [B, Hq, n, D]
  const at::Tensor& held = window.queries[layer];
  at::Tensor queries = held.defined() ? at::cat({held, fresh}, 2) : fresh;
  const int64_t rows = std::min(queries.size(2), params_.window_size);
  queries = queries.narrow(2, queries.size(2) - rows, rows);
  DecodingUpdate update;
  if (due(n, tokens_seen)) {
    checks::check_kv(op, forward.keys, forward.values);
    LayerInputs in = kv_only(forward, forward.keys, forward.values);
    in.queries = queries;
    if (forward.keys.size(2) >= params_.budget) {
      update.kind = DecodingUpdate::Kind::kReplace;
      update.replacement = keep_budget(in);
    }
  }
  window.queries[layer] = queries;  // only once nothing can fail
  return update;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "RKVDecodingPress",
      PressKind::kDecoding,
      "R-KV while generating: every divide_length tokens, RKVPress's best `budget` tokens of each head",
      {{}, {}, {}, "the queries of the prefill's last window_size positions and of every decoding forward"},
      from_params<RKVDecodingPress>,
      "the budget is its budget parameter"};
});

}  // namespace

}  // namespace kvpress
