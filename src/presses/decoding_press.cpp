// DecodingPress: kvpress's decoding-phase compression (hidden-state buffer, interval, target size).
#include "kvpress/presses/decoding_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "layer_slices.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

// Post-RoPE float32 queries [B, Hq, m, D] of the buffered hidden states, rotated as kvpress's
// window attention rotates them during decoding: with the latest forward's cos/sin [n, D] aligned
// to the end (kvpress slices cos[:, -window:] of the current forward's position_embeddings), a
// single row being broadcast over every buffered position. m = b when n == 1, else min(n, b).
at::Tensor buffered_queries(const LayerInputs& in, const char* op) {
  const at::Tensor& h = in.hidden_states;
  checks::check_rank(op, "hidden_states", h, 3, "[batch, buffered, hidden]");
  TORCH_CHECK(h.size(0) == in.keys.size(0) && h.size(1) > 0, op, ": hidden_states must be [", in.keys.size(0),
              ", buffered > 0, hidden], got ", checks::shape_str(h));
  checks::check_same_device(op, "hidden_states", h, "keys", in.keys);
  const int64_t b = h.size(1), d = in.keys.size(3);
  TORCH_CHECK(in.q_proj.defined(), op, ": needs q_proj with hidden_states (to rebuild the buffered queries)");
  TORCH_CHECK(in.cos.defined() && in.sin.defined(), op,
              ": needs cos/sin of the latest forward ([n, head_dim]) with hidden_states");
  TORCH_CHECK(in.cos.dim() == 2 && in.cos.size(0) > 0 && in.cos.size(1) == d && in.sin.sizes() == in.cos.sizes(), op,
              ": cos and sin must be [n, ", d, "] (the latest forward's RoPE rows), got ", checks::shape_str(in.cos),
              " and ", checks::shape_str(in.sin));
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even for RoPE, got ", d);
  const int64_t n = in.cos.size(0);
  const int64_t m = n == 1 ? b : std::min(n, b);
  const at::Tensor q = ops::project_queries(h.narrow(1, b - m, m), in, op);  // [B, Hq, m, D]
  const at::Tensor cos = (n == 1 ? in.cos : in.cos.narrow(0, n - m, m)).to(q.device(), at::kFloat);
  const at::Tensor sin = (n == 1 ? in.sin : in.sin.narrow(0, n - m, m)).to(q.device(), at::kFloat);
  return q * cos + ops::rotate_half(q) * sin;  // [m, D] or [1, D] broadcast over the m positions
}

}  // namespace

DecodingPress::DecodingPress(ScorerFactory make_press, int64_t compression_interval, int64_t target_size,
                             int64_t hidden_states_buffer_size)
    : DecodingPress(std::move(make_press), compression_interval, target_size, hidden_states_buffer_size,
                    "DecodingPress") {}

DecodingPress::DecodingPress(ScorerFactory make_press, int64_t compression_interval, int64_t target_size,
                             int64_t hidden_states_buffer_size, const char* op)
    : make_press_(std::move(make_press)),
      compression_interval_(compression_interval),
      target_size_(target_size),
      hidden_states_buffer_size_(hidden_states_buffer_size) {
  TORCH_CHECK(make_press_, op, ": press must be a ScorerPress factory, got an empty function");
  press_ = make_press_(0.0);
  TORCH_CHECK(press_ != nullptr, op, ": press must be a ScorerPress, got nullptr");
  TORCH_CHECK(!press_->head_ragged(), op, ": press must keep the same number of tokens in every head, got ",
              press_->name(), " selecting across heads");
  checks::check_positive(op, "compression_interval", compression_interval);
  checks::check_positive(op, "target_size", target_size);
  checks::check_non_negative(op, "hidden_states_buffer_size", hidden_states_buffer_size);
}

int64_t DecodingPress::target_size(int64_t /*tokens_seen*/) const { return target_size_; }

double DecodingPress::find_target_compression_ratio(int64_t k_len, int64_t target) {
  if (k_len <= target) return 0.0;
  // Same double operations as kvpress, so the same ratio (and the same int() rounding) comes out.
  const double q_len = static_cast<double>(k_len);
  double ratio = 1.0 - (static_cast<double>(target) / q_len);
  double low = 0.0, high = 1.0;
  for (int iteration = 0; iteration < 20; ++iteration) {
    const int64_t n = static_cast<int64_t>(q_len * (1.0 - ratio));
    if (n == target) break;
    if (n > target) {
      low = ratio;
      ratio = (ratio + high) / 2.0;
    } else {
      high = ratio;
      ratio = (low + ratio) / 2.0;
    }
  }
  return ratio;
}

KV DecodingPress::compress(const LayerInputs& inputs) const {
  checks::check_kv((name() + ".compress").c_str(), inputs.keys, inputs.values);
  return compress_to(inputs, target_size(inputs.keys.size(2)));
}

KV DecodingPress::compress_to(const LayerInputs& in, int64_t target) const {
  const std::string op_name = name() + ".compress";
  const char* op = op_name.c_str();
  checks::check_kv(op, in.keys, in.values);
  checks::check_positive(op, "target_size", target);
  const int64_t seq = in.keys.size(2);
  const double ratio = find_target_compression_ratio(seq, target);
  if (ratio == 0.0) return budget::keep_all(in);  // kvpress's ScorerPress.compress returns the cache untouched
  const at::Tensor scores = inner_scores_at(in, ratio, op);
  return ops::gather_kv(in.keys, in.values, ops::topk_indices(scores, ops::n_kept(seq, ratio)));
}

at::Tensor DecodingPress::inner_scores_at(const LayerInputs& in, double ratio, const char* op) const {
  // The inner press sees the cache, the latest attentions and the buffered queries; hidden_states
  // and cos/sin describe only the latest forward.
  LayerInputs inner = kv_only(in, in.keys, in.values);
  inner.attentions = in.attentions;
  inner.q_proj = in.q_proj;
  inner.norm_eps = in.norm_eps;
  if (in.hidden_states.defined()) inner.queries = buffered_queries(in, op);
  // kvpress sets the inner press's ratio before scoring (StreamingLLM's scores depend on it).
  const std::shared_ptr<const ScorerPress> scorer = make_press_(ratio);
  TORCH_CHECK(scorer != nullptr, op, ": press must be a ScorerPress, got nullptr at ratio ", ratio);
  at::Tensor scores;
  try {
    scores = scorer->score(inner);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, op, ": inner press ", press_->name(),
                " cannot score a decoding cache (it gets keys/values, the buffered queries and the latest "
                "attentions; no hidden_states or cos/sin): ",
                e.what_without_backtrace());
  }
  return budget::checked_inner_scores(scores, in, op);
}

bool DecodingPress::due(int64_t layer_idx, int64_t n, int64_t tokens_seen, const DecodingState& state) const {
  const auto layer = static_cast<size_t>(layer_idx);
  const int64_t steps = layer < state.steps.size() ? state.steps[layer] : 0;
  return steps + 1 >= compression_interval_ || n >= target_size(tokens_seen);
}

std::unique_ptr<PressSequenceState> DecodingPress::new_sequence_state() const {
  return std::make_unique<DecodingState>();
}

DecodingRole DecodingPress::decoding_role() const {
  DecodingRole role;
  role.compresses = true;
  role.scorer = press_.get();
  role.reads_cache_every_step = reads_cache_every_step();
  return role;
}

bool DecodingPress::decoding_reads_cache(int64_t layer, int64_t n, int64_t tokens_seen,
                                         const PressSequenceState& state) const {
  return reads_cache_every_step() || due(layer, n, tokens_seen, own_sequence_state<const DecodingState>(state, *this));
}

DecodingUpdate DecodingPress::decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                              PressSequenceState& state) const {
  DecodingUpdate update;
  if (std::optional<KV> kv = step(forward, tokens_seen, own_sequence_state<DecodingState>(state, *this))) {
    update.kind = DecodingUpdate::Kind::kReplace;
    update.replacement = std::move(*kv);
  }
  return update;
}

std::optional<KV> DecodingPress::step(const LayerInputs& forward, int64_t tokens_seen, DecodingState& state) const {
  const std::string op_name = name() + ".step";
  const char* op = op_name.c_str();
  TORCH_CHECK(forward.hidden_states.defined(), op, ": needs hidden_states (the forward's attention input), got none");
  checks::check_rank(op, "hidden_states", forward.hidden_states, 3, "[batch, n, hidden]");
  TORCH_CHECK(forward.layer_idx >= 0, op, ": layer_idx must be >= 0, got ", forward.layer_idx);
  TORCH_CHECK(tokens_seen >= forward.hidden_states.size(1), op, ": tokens_seen must be >= the forward's ",
              forward.hidden_states.size(1), " tokens, got ", tokens_seen);
  const auto layer = static_cast<size_t>(forward.layer_idx);
  const size_t layers = std::max<size_t>(layer + 1, static_cast<size_t>(std::max<int64_t>(forward.num_layers, 1)));
  if (state.hidden_states.size() < layers) state.hidden_states.resize(layers);
  if (state.steps.size() < layers) state.steps.resize(layers, 0);
  const int64_t n = forward.hidden_states.size(1);
  const bool compress_now = due(forward.layer_idx, n, tokens_seen, state);
  if (compress_now) checks::check_kv(op, forward.keys, forward.values);
  std::vector<at::Tensor>& buffer = state.hidden_states[layer];
  buffer.push_back(forward.hidden_states);
  ++state.steps[layer];
  std::optional<KV> out;
  if (compress_now) {
    const int64_t target = target_size(tokens_seen);
    LayerInputs in = forward;
    in.hidden_states = at::cat(buffer, 1);
    out = compress_to(in, target);
    state.steps[layer] = 0;
    buffer.clear();  // kvpress: otherwise the buffer and the cache would disagree
  }
  if (hidden_states_buffer_size_ == 0) {
    buffer.clear();
  } else if (static_cast<int64_t>(buffer.size()) > hidden_states_buffer_size_) {
    buffer.erase(buffer.begin(), buffer.end() - hidden_states_buffer_size_);
  }
  return out;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "DecodingPress",
      PressKind::kDecoding,
      "compresses during decoding: every compression_interval steps, to target_size tokens",
      {{}, {}, {}, "the inner press gets keys/values, queries of the buffered hidden states and attentions"},
      [](double, ParamReader& p) {
        ScorerFactory inner = scorer_factory(p, kDecodingInnerPressHelp);
        DecodingPress::Params d;
        p.read_all(d);
        return std::make_unique<DecodingPress>(inner, d.compression_interval, d.target_size,
                                               d.hidden_states_buffer_size);
      },
      "the budget is target_size; CompressionRatioDecodingPress keeps a fraction"};
});

}  // namespace

}  // namespace kvpress
