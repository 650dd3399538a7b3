// TriAttentionPress: RoPE-frequency scores of the keys from calibrated query statistics, one
// selection for every layer while decoding (docs/PRESS_NOTES.md, "TriAttentionPress").
#include "kvpress/presses/triattention_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <utility>

#include "budget.h"
#include "checks.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

namespace {

constexpr const char* kName = "TriAttentionPress";
constexpr double kStdFloor = 1e-6;  // the authors' clamp of a row's standard deviation

void check_statistics(const std::string& where, const TriAttentionPress::Statistics& s) {
  TORCH_CHECK(s.q_mean_real.defined() && s.q_mean_imag.defined() && s.q_abs_mean.defined(), where,
              ": q_mean_real, q_mean_imag and q_abs_mean must all be given");
  const at::Tensor& real = s.q_mean_real;
  TORCH_CHECK(real.dim() == 3 && at::isFloatingType(real.scalar_type()) && real.numel() > 0, where,
              ": q_mean_real must be a float [num_layers, num_heads, head_dim / 2] tensor, got ",
              checks::shape_str(real));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"q_mean_imag", s.q_mean_imag},
                                std::pair<const char*, const at::Tensor&>{"q_abs_mean", s.q_abs_mean}})
    TORCH_CHECK(t.sizes() == real.sizes() && at::isFloatingType(t.scalar_type()), where, ": ", name,
                " must be a float tensor of q_mean_real's shape ", checks::shape_str(real), ", got ",
                checks::shape_str(t));
}

TriAttentionPress::Statistics contiguous_float(const TriAttentionPress::Statistics& s) {
  return {s.q_mean_real.to(at::kCPU, at::kFloat).contiguous(), s.q_mean_imag.to(at::kCPU, at::kFloat).contiguous(),
          s.q_abs_mean.to(at::kCPU, at::kFloat).contiguous()};
}

// The slots [first, end) in each of kv_heads heads, [kv_heads, end - first] int64.
at::Tensor slots_of_head_rows(int64_t kv_heads, int64_t first, int64_t end) {
  return at::arange(first, end, at::kLong).unsqueeze(0).expand({kv_heads, end - first});
}

}  // namespace

TriAttentionPress::TriAttentionPress(const Params& params)
    : TriAttentionPress(params, params.stats_file.empty() ? Statistics{} : load_statistics(params.stats_file)) {}

TriAttentionPress::TriAttentionPress(const Params& params, Statistics statistics) : params_(params) {
  check_params(kName, params_);
  if (statistics.q_mean_real.defined() || statistics.q_mean_imag.defined() || statistics.q_abs_mean.defined()) {
    check_statistics(kName, statistics);
    statistics_ = contiguous_float(statistics);
  }
  offsets_ = geometric_offsets(params_.offset_max_length);
}

at::Tensor TriAttentionPress::geometric_offsets(int64_t max_length) {
  checks::check_positive("TriAttentionPress::geometric_offsets", "max_length", max_length);
  std::vector<float> offsets;
  for (int64_t value = 1; value <= max_length; value *= 2) offsets.push_back(static_cast<float>(value));
  return at::tensor(offsets, at::kFloat);
}

// ---- statistics ------------------------------------------------------------------------------

TriAttentionPress::Statistics TriAttentionPress::calibrate(const std::vector<LayerInputs>& layers) {
  constexpr const char* op = "TriAttentionPress::calibrate";
  TORCH_CHECK(!layers.empty(), op, ": layers must hold at least one layer, got none");
  std::vector<at::Tensor> real, imag, modulus;
  for (const LayerInputs& in : layers) {
    checks::check_kv(op, in.keys, in.values);
    const int64_t s = in.keys.size(2);
    const at::Tensor q = ops::prerope_queries(in, 0, s, op);  // [B, Hq, S, D] float32
    const int64_t f = q.size(3) / 2;
    TORCH_CHECK(q.size(3) % 2 == 0, op, ": head_dim must be even for RoPE pairs, got ", q.size(3));
    const at::Tensor lo = q.narrow(3, 0, f), hi = q.narrow(3, f, f);  // the pairs' real and imaginary parts
    real.push_back(lo.mean(at::IntArrayRef{0, 2}));
    imag.push_back(hi.mean(at::IntArrayRef{0, 2}));
    modulus.push_back(at::hypot(lo, hi).mean(at::IntArrayRef{0, 2}));
  }
  return {at::stack(real), at::stack(imag), at::stack(modulus)};
}

void TriAttentionPress::save_statistics(const std::string& path, const Statistics& statistics) {
  check_statistics("TriAttentionPress::save_statistics", statistics);
  io::save_safetensors(path, {{"q_mean_real", statistics.q_mean_real},
                              {"q_mean_imag", statistics.q_mean_imag},
                              {"q_abs_mean", statistics.q_abs_mean}});
}

TriAttentionPress::Statistics TriAttentionPress::load_statistics(const std::string& path) {
  const io::SafetensorsFile file = io::load_safetensors(path);
  const std::string where = std::string(kName) + ": " + path;
  Statistics s{io::required_tensor(file, "q_mean_real", where), io::required_tensor(file, "q_mean_imag", where),
               io::required_tensor(file, "q_abs_mean", where)};
  check_statistics(where, s);
  return contiguous_float(s);
}

// ---- scores ----------------------------------------------------------------------------------

at::Tensor TriAttentionPress::frequency_scores(const at::Tensor& keys, const at::Tensor& positions, int64_t round_start,
                                               const at::Tensor& q_mean_real, const at::Tensor& q_mean_imag,
                                               const at::Tensor& q_abs_mean, const at::Tensor& inv_freq,
                                               const at::Tensor& offsets, bool max_over_offsets) {
  constexpr const char* op = "TriAttentionPress::frequency_scores";
  checks::check_rank(op, "keys", keys, 3, "[Hkv, n, D]");
  const int64_t hkv = keys.size(0), n = keys.size(1), d = keys.size(2), f = d / 2;
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even for RoPE pairs, got ", d);
  TORCH_CHECK(positions.sizes() == at::IntArrayRef({hkv, n}) && !at::isFloatingType(positions.scalar_type()), op,
              ": positions must be integer [", hkv, ", ", n, "], got ", checks::shape_str(positions));
  TORCH_CHECK(q_mean_real.dim() == 2 && q_mean_real.size(1) == f && q_mean_real.size(0) % hkv == 0, op,
              ": q_mean_real must be [Hq, ", f, "] with Hq a multiple of ", hkv, ", got ",
              checks::shape_str(q_mean_real));
  TORCH_CHECK(q_mean_imag.sizes() == q_mean_real.sizes() && q_abs_mean.sizes() == q_mean_real.sizes(), op,
              ": q_mean_imag and q_abs_mean must be ", checks::shape_str(q_mean_real), ", got ",
              checks::shape_str(q_mean_imag), " and ", checks::shape_str(q_abs_mean));
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.size(0) == f, op, ": inv_freq must be [", f, "], got ",
              checks::shape_str(inv_freq));
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) > 0, op, ": offsets must be [O > 0], got ",
              checks::shape_str(offsets));
  const int64_t hq = q_mean_real.size(0), group = hq / hkv;
  const at::Device device = keys.device();
  const auto float32 = at::TensorOptions().device(device).dtype(at::kFloat);
  const at::Tensor omega = inv_freq.to(float32);  // [F]
  // RoPE undone with the rotary's own float32 tables (HF: angle = position * inv_freq, each half of D).
  const at::Tensor p = positions.to(float32);        // [Hkv, n]
  const at::Tensor angle = p.unsqueeze(-1) * omega;  // [Hkv, n, F]
  const at::Tensor c = angle.cos(), s = angle.sin();
  const at::Tensor k = keys.to(float32);
  const at::Tensor k_lo = k.narrow(2, 0, f), k_hi = k.narrow(2, f, f);
  const at::Tensor re = k_lo * c + k_hi * s, im = k_hi * c - k_lo * s;  // K_f = k_f e^{-i p w_f}
  const at::Tensor k_abs = at::hypot(re, im);                           // [Hkv, n, F]
  const at::Tensor qr = q_mean_real.to(float32), qi = q_mean_imag.to(float32);
  const at::Tensor q_abs = at::hypot(qr, qi);                      // [Hq, F]
  const at::Tensor extra_weight = q_abs_mean.to(float32) - q_abs;  // E|q_f| - |q̄_f|
  const at::Tensor offs = offsets.to(float32);
  const at::Tensor delta = static_cast<float>(round_start) - p;  // [Hkv, n]
  at::Tensor out = at::empty({hq, n}, float32);
  for (int64_t h = 0; h < hq; ++h) {  // one query head at a time: [n, O, F] at most in memory
    const int64_t g = h / group;
    const at::Tensor a = qr[h], b = qi[h];
    const at::Tensor kr = re[g], ki = im[g], ka = k_abs[g];  // [n, F]
    // arg(q̄ conj(K)): (a + ib)(kr - i ki) = (a kr + b ki) + i (b kr - a ki)
    const at::Tensor phi = at::atan2(b * kr - a * ki, a * kr + b * ki);                               // [n, F]
    const at::Tensor amp = q_abs[h] * ka;                                                             // [n, F]
    const at::Tensor phase = (delta[g].unsqueeze(1) + offs).unsqueeze(2) * omega + phi.unsqueeze(1);  // [n, O, F]
    const at::Tensor combined = (amp.unsqueeze(1) * phase.cos()).sum(2) + (extra_weight[h] * ka).sum(1, true);
    out[h] = max_over_offsets ? std::get<0>(combined.max(1)) : combined.mean(1);
  }
  return out;
}

at::Tensor TriAttentionPress::layer_scores(const LayerInputs& forward, const TriAttentionState& state,
                                           int64_t tokens_seen, const char* op) const {
  const int64_t layer = forward.layer_idx, hkv = forward.keys.size(1), d = forward.keys.size(3);
  // On a tensor-parallel rank the keys are the layer's KV heads [first, first + hkv) of layer_kv_heads.
  const KVHeadRange& range = forward.kv_head_range;
  const int64_t layer_kv_heads = range.layer_kv_heads > 0 ? range.layer_kv_heads : hkv;
  const int64_t heads = statistics_.q_mean_real.size(1);
  TORCH_CHECK(layer < statistics_.q_mean_real.size(0), op, ": the statistics cover ", statistics_.q_mean_real.size(0),
              " layers, got layer_idx ", layer);
  TORCH_CHECK(statistics_.q_mean_real.size(2) * 2 == d && heads % layer_kv_heads == 0, op,
              ": the statistics' [num_heads, head_dim / 2] = ", heads, " x ", statistics_.q_mean_real.size(2),
              " do not fit a layer of ", layer_kv_heads, " KV heads of head_dim ", d);
  TORCH_CHECK(forward.inv_freq.defined(), op, ": needs inv_freq (the model's RoPE inverse frequencies), got none");
  const int64_t group = heads / layer_kv_heads;
  const auto rows = [&](const at::Tensor& t) { return t[layer].narrow(0, range.first * group, hkv * group); };
  const int64_t first = state.prompt_length, m = forward.keys.size(2) - first;
  const at::Tensor scores = frequency_scores(
      forward.keys[0].narrow(1, first, m), state.positions.narrow(1, first, m), tokens_seen,
      rows(statistics_.q_mean_real), rows(statistics_.q_mean_imag), rows(statistics_.q_abs_mean), forward.inv_freq,
      offsets_.to(forward.keys.device()), params_.score_aggregation == "max");  // [hkv * group, m]
  const at::Tensor mean = scores.mean(1, true);
  const at::Tensor std = scores.std(1, /*unbiased=*/false, true).clamp_min(kStdFloor);
  const at::Tensor z = (scores - mean) / std;
  return std::get<0>(z.view({hkv, z.size(0) / hkv, m}).max(1)).cpu();  // [Hkv, m]
}

at::Tensor TriAttentionPress::select(const TriAttentionState& state, int64_t num_layers) const {
  const int64_t hkv = state.positions.size(0), prompt = state.prompt_length;
  // The authors' quirk: with no budget left over the prompt, the first `budget` slots stay.
  if (prompt >= params_.budget) return slots_of_head_rows(hkv, 0, params_.budget);
  const at::Tensor mean = state.layer_score_sum / static_cast<double>(num_layers);  // [Hkv, m]
  const at::Tensor best = ops::topk_indices(mean.unsqueeze(0), params_.budget - prompt)[0] + prompt;
  return at::cat({slots_of_head_rows(hkv, 0, prompt), best}, 1);  // [Hkv, budget] ascending
}

// ---- the lifecycle ---------------------------------------------------------------------------

KV TriAttentionPress::compress(const LayerInputs& inputs) const {
  checks::check_kv((std::string(kName) + ".compress").c_str(), inputs.keys, inputs.values);
  return budget::keep_all(inputs);  // nothing at prefill: the method selects while decoding only
}

std::unique_ptr<PressSequenceState> TriAttentionPress::new_sequence_state() const {
  return std::make_unique<TriAttentionState>();
}

DecodingRole TriAttentionPress::decoding_role() const {
  DecodingRole role;
  role.compresses = true;
  role.keeps_every_layer = true;
  return role;
}

namespace {

// Cache length at `tokens_seen` as the state records it (this forward's n tokens included).
int64_t recorded_length(const TriAttentionState& state, int64_t n, int64_t tokens_seen) {
  if (!state.positions.defined()) return tokens_seen;  // the first decoding forward: nothing evicted yet
  return state.positions.size(1) + (state.tokens_seen == tokens_seen ? 0 : n);
}

}  // namespace

bool TriAttentionPress::decoding_reads_cache(int64_t /*layer*/, int64_t n, int64_t tokens_seen,
                                             const PressSequenceState& state) const {
  return due(recorded_length(own_sequence_state<const TriAttentionState>(state, *this), n, tokens_seen));
}

DecodingUpdate TriAttentionPress::decoding_update(const LayerInputs& forward, int64_t tokens_seen,
                                                  PressSequenceState& sequence_state) const {
  const std::string op_name = std::string(kName) + ".decoding_update";
  const char* op = op_name.c_str();
  TriAttentionState& state = own_sequence_state<TriAttentionState>(sequence_state, *this);
  TORCH_CHECK(statistics_.q_mean_real.defined(), op,
              ": needs the model's query statistics (stats_file, or TriAttentionPress::calibrate), got none");
  TORCH_CHECK(forward.hidden_states.defined(), op, ": needs hidden_states (the forward's attention input), got none");
  checks::check_rank(op, "hidden_states", forward.hidden_states, 3, "[batch, n, hidden]");
  checks::check_rank(op, "keys", forward.keys, 4, "[batch, Hkv, L, D]");
  TORCH_CHECK(forward.keys.size(0) == 1, op, ": decodes one sequence per state (batch 1), got keys ",
              checks::shape_str(forward.keys));
  TORCH_CHECK(forward.num_layers == statistics_.q_mean_real.size(0), op, ": the statistics cover ",
              statistics_.q_mean_real.size(0), " layers, the model has num_layers ", forward.num_layers);
  const int64_t n = forward.hidden_states.size(1), layer = forward.layer_idx, hkv = forward.keys.size(1);
  TORCH_CHECK(tokens_seen >= n && tokens_seen >= state.tokens_seen, op,
              ": tokens_seen must grow and be >= the forward's ", n, " tokens, got ", tokens_seen, " after ",
              state.tokens_seen);

  // Everything is computed into `next` and becomes the state only once nothing can fail.
  TriAttentionState next = state;
  if (next.tokens_seen != tokens_seen) {  // a new forward: its tokens join every head's record
    TORCH_CHECK(layer == 0, op, ": a forward must reach its layers in order from 0, got layer ", layer,
                " first at tokens_seen ", tokens_seen);
    if (!next.positions.defined()) {
      next.prompt_length = tokens_seen - n;
      next.positions = slots_of_head_rows(hkv, 0, tokens_seen).contiguous();
    } else {
      next.positions = at::cat({next.positions, slots_of_head_rows(hkv, tokens_seen - n, tokens_seen)}, 1);
    }
    next.tokens_seen = tokens_seen;
    next.layer_score_sum = at::Tensor();
    next.layers_scored = 0;
  }
  const int64_t length = next.positions.size(1);
  DecodingUpdate update;
  if (due(length)) {
    TORCH_CHECK(forward.keys.size(2) == length && next.positions.size(0) == hkv, op, ": layer ", layer, " holds ",
                forward.keys.size(2), " tokens in ", hkv, " KV heads, the press's record of the sequence ", length,
                " in ", next.positions.size(0),
                " (every layer must hold the same tokens: no other press may compress this cache)");
    TORCH_CHECK(next.layers_scored == layer, op, ": a compressing forward must give every layer in order, got layer ",
                layer, " after ", next.layers_scored, " scored layers");
    if (next.prompt_length < params_.budget) {
      const at::Tensor scores = layer_scores(forward, next, tokens_seen, op);
      next.layer_score_sum = next.layers_scored == 0 ? scores : next.layer_score_sum + scores;
    }
    ++next.layers_scored;
    if (layer == forward.num_layers - 1) {
      const at::Tensor keep = select(next, forward.num_layers);  // [Hkv, budget]
      next.positions = next.positions.gather(1, keep);
      next.layer_score_sum = at::Tensor();
      next.layers_scored = 0;
      update.kind = DecodingUpdate::Kind::kKeepEveryLayer;
      update.keep = keep.unsqueeze(0).to(forward.keys.device());
    }
  }
  state = std::move(next);
  return update;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"TriAttentionPress",
                    PressKind::kDecoding,
                    "TriAttention while generating: at budget + divide_length tokens, every layer keeps the prompt "
                    "and the decoding tokens whose keys best fit the model's calibrated queries at future distances",
                    {{},
                     {},
                     {},
                     "hidden_states, inv_freq and layer_idx / num_layers of every decoding forward; the calibrated "
                     "query statistics (stats_file)"},
                    from_params<TriAttentionPress>,
                    "the budget is its budget parameter"};
});

}  // namespace

}  // namespace kvpress
