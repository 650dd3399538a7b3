// RoPE, GQA reduction, query recomputation and window attention.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "checks.h"
#include "kvpress/ops.h"
#include "rope_heads/rope_heads.h"

namespace kvpress::ops {
namespace {

// RMSNorm over the last dim with weight [D] (Qwen3-style q_norm/k_norm), in float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const char* op, const char* name) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": ", name, " must be [", x.size(-1),
              "] ([head_dim]), got ", checks::shape_str(weight));
  const at::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
  return x * at::rsqrt(variance + eps) * weight.to(at::kFloat);
}

// hidden [B, n, hidden] @ proj^T (+ bias [heads * D] when defined: Qwen2-style attention biases)
// -> [B, heads, n, D] in float32, RMS-normed per head by `norm` when it is defined (Qwen3-style
// q_norm / k_norm). `model_rounding`: the product is computed in
// hidden's dtype by at::linear, the op the model's nn.Linear runs, and so rounded as the model
// rounds it on every CPU (a float32 product rounded afterwards differs in the last bit wherever
// that CPU's reduced-precision GEMM accumulates in another order); else in float32.
at::Tensor project_heads(const at::Tensor& hidden, const at::Tensor& proj, const at::Tensor& bias,
                         const at::Tensor& norm, double eps, int64_t heads, int64_t head_dim, const char* op,
                         const char* proj_name, const char* bias_name, const char* norm_name,
                         bool model_rounding = false) {
  checks::check_rank(op, proj_name, proj, 2, "[heads * head_dim, hidden]");
  TORCH_CHECK(proj.size(0) == heads * head_dim && proj.size(1) == hidden.size(2), op, ": ", proj_name, " must be [",
              heads * head_dim, ", ", hidden.size(2), "], got ", checks::shape_str(proj));
  checks::check_same_device(op, proj_name, proj, "hidden_states", hidden);
  if (bias.defined()) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == heads * head_dim, op, ": ", bias_name, " must be [",
                heads * head_dim, "] (", proj_name, "'s rows), got ", checks::shape_str(bias));
    checks::check_same_device(op, bias_name, bias, "hidden_states", hidden);
  }
  const int64_t batch = hidden.size(0), n = hidden.size(1);
  const auto as = [&](const at::Tensor& t, at::ScalarType dtype) { return t.defined() ? t.to(dtype) : t; };
  const at::Tensor product =
      model_rounding ? at::linear(hidden, proj.to(hidden.scalar_type()), as(bias, hidden.scalar_type())).to(at::kFloat)
                     : at::linear(hidden.to(at::kFloat), proj.to(at::kFloat), as(bias, at::kFloat));
  at::Tensor x = product.view({batch, n, heads, head_dim}).transpose(1, 2);
  return norm.defined() ? rms_norm(x, norm, eps, op, norm_name) : x;
}

void check_hidden(const char* op, const LayerInputs& in) {
  checks::check_rank(op, "hidden_states", in.hidden_states, 3, "[batch, seq_len, hidden]");
  TORCH_CHECK(in.hidden_states.size(0) == in.keys.size(0) && in.hidden_states.size(1) == in.keys.size(2), op,
              ": hidden_states must be [", in.keys.size(0), ", ", in.keys.size(2), ", hidden] to match keys, got ",
              checks::shape_str(in.hidden_states));
  checks::check_same_device(op, "hidden_states", in.hidden_states, "keys", in.keys);
}

}  // namespace

at::Tensor rotate_half(const at::Tensor& x) {
  constexpr const char* op = "rotate_half";
  checks::check_defined(op, "x", x);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, op, ": x must have an even last dimension, got ",
              checks::shape_str(x));
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  checks::check_rope("apply_rope", x, cos, sin);
  return x * cos.to(x.scalar_type()) + rotate_half(x) * sin.to(x.scalar_type());
}

at::Tensor invert_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  static const auto op =
      dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kvpress::invert_rope");
  checks::check_defined("invert_rope", "x", x);  // an undefined tensor would dispatch nowhere
  return op.call(x, cos, sin);
}

at::Tensor composite::invert_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  checks::check_rope("invert_rope", x, cos, sin);
  // R(theta)^-1 = R(-theta): same cos, negated sin.
  return x * cos.to(x.scalar_type()) - rotate_half(x) * sin.to(x.scalar_type());
}

at::Tensor group_mean(const at::Tensor& per_query_head, int64_t num_kv_heads) {
  constexpr const char* op = "group_mean";
  checks::check_defined(op, "per_query_head", per_query_head);
  TORCH_CHECK(per_query_head.dim() >= 2, op, ": per_query_head must be [batch, heads, ...], got ",
              checks::shape_str(per_query_head));
  checks::check_gqa(op, per_query_head.size(1), num_kv_heads);
  std::vector<int64_t> grouped{per_query_head.size(0), num_kv_heads, per_query_head.size(1) / num_kv_heads};
  for (int64_t d = 2; d < per_query_head.dim(); ++d) grouped.push_back(per_query_head.size(d));
  return per_query_head.reshape(grouped).mean(2);
}

int64_t num_query_heads(const LayerInputs& in) {
  if (in.num_heads > 0) return in.num_heads;
  if (in.queries.defined() && in.queries.dim() == 4) return in.queries.size(1);
  if (in.attentions.defined() && in.attentions.dim() == 4) return in.attentions.size(1);
  if (in.q_proj.defined() && in.q_proj.dim() == 2 && in.keys.defined() && in.keys.dim() == 4 && in.keys.size(3) > 0 &&
      in.q_proj.size(0) % in.keys.size(3) == 0)
    return in.q_proj.size(0) / in.keys.size(3);
  TORCH_CHECK(false,
              "num_query_heads: the number of query heads is unknown: set num_heads or give "
              "queries, attentions or q_proj");
}

at::Tensor window_queries(const LayerInputs& in, int64_t n_last, const char* op) {
  checks::check_keys(op, in.keys);
  const int64_t kv_heads = in.keys.size(1), seq = in.keys.size(2), head_dim = in.keys.size(3);
  checks::check_window(op, "window_size", n_last, seq + 1);
  if (in.queries.defined()) {
    checks::check_queries(op, in.queries, in.keys, "q_len");
    TORCH_CHECK(in.queries.size(2) >= n_last, op, ": queries must hold at least the last ", n_last,
                " positions, got q_len ", in.queries.size(2));
    return in.queries.narrow(2, in.queries.size(2) - n_last, n_last);
  }
  TORCH_CHECK(in.hidden_states.defined() && in.q_proj.defined(), op,
              ": needs attentions, queries, or hidden_states + q_proj + cos/sin; got none of them");
  check_hidden(op, in);
  checks::check_gqa(op, num_query_heads(in), kv_heads);
  const at::Tensor q = project_queries(in.hidden_states.narrow(1, seq - n_last, n_last), in, op);
  checks::check_defined(op, "cos", in.cos);
  checks::check_defined(op, "sin", in.sin);
  TORCH_CHECK(in.cos.dim() == 2 && in.cos.size(0) == seq, op, ": cos must be [", seq, ", ", head_dim,
              "] ([seq_len, head_dim]), got ", checks::shape_str(in.cos));
  TORCH_CHECK(in.sin.dim() == 2 && in.sin.size(0) == seq, op, ": sin must be [", seq, ", ", head_dim,
              "] ([seq_len, head_dim]), got ", checks::shape_str(in.sin));
  return apply_rope(q, in.cos.narrow(0, seq - n_last, n_last).to(at::kFloat),
                    in.sin.narrow(0, seq - n_last, n_last).to(at::kFloat));
}

at::Tensor prerope_keys(const LayerInputs& in, const char* op) {
  checks::check_keys(op, in.keys);
  if (in.cos.defined() || in.sin.defined()) {
    return invert_rope(in.keys.to(at::kFloat), in.cos.to(at::kFloat), in.sin.to(at::kFloat));
  }
  TORCH_CHECK(in.hidden_states.defined() && in.k_proj.defined(), op,
              ": needs cos/sin (to invert RoPE on the cached keys) or hidden_states + k_proj");
  check_hidden(op, in);
  // kvpress's get_prerope_key_states runs the model's k_proj in the model's dtype.
  return project_heads(in.hidden_states, in.k_proj, in.k_bias, in.k_norm, in.norm_eps, in.keys.size(1), in.keys.size(3),
                       op, "k_proj", "k_bias", "k_norm", /*model_rounding=*/true);
}

at::Tensor project_queries(const at::Tensor& hidden, const LayerInputs& in, const char* op) {
  checks::check_rank(op, "hidden_states", hidden, 3, "[batch, n, hidden]");
  checks::check_keys(op, in.keys);
  checks::check_defined(op, "q_proj", in.q_proj);
  return project_heads(hidden, in.q_proj, in.q_bias, in.q_norm, in.norm_eps, num_query_heads(in), in.keys.size(3), op,
                       "q_proj", "q_bias", "q_norm");
}

at::Tensor prerope_queries(const LayerInputs& in, int64_t start, int64_t n, const char* op) {
  checks::check_keys(op, in.keys);
  const int64_t batch = in.keys.size(0), seq = in.keys.size(2), head_dim = in.keys.size(3);
  TORCH_CHECK(start >= 0 && n >= 0 && start + n <= seq, op, ": positions [", start, ", ", start + n,
              ") must lie in [0, seq_len (", seq, "))");
  // The engine's queries of every position, when given, cost an elementwise RoPE inversion where
  // recomputing them costs a GEMM over the hidden states.
  const bool all_queries = in.queries.defined() && in.queries.dim() == 4 && in.queries.size(2) == seq;
  if (!(all_queries && in.cos.defined() && in.sin.defined()) && in.hidden_states.defined() && in.q_proj.defined()) {
    check_hidden(op, in);
    return project_queries(in.hidden_states.narrow(1, start, n), in, op);
  }
  TORCH_CHECK(in.queries.defined() && in.cos.defined() && in.sin.defined(), op,
              ": needs hidden_states + q_proj, or queries of all positions + cos/sin; got neither");
  checks::check_rank(op, "queries", in.queries, 4, "[batch, num_heads, seq_len, head_dim]");
  TORCH_CHECK(in.queries.size(0) == batch && in.queries.size(2) == seq && in.queries.size(3) == head_dim, op,
              ": queries must cover all positions, [", batch, ", num_heads, ", seq, ", ", head_dim, "], got ",
              checks::shape_str(in.queries));
  TORCH_CHECK(in.cos.dim() == 2 && in.cos.size(0) == seq && in.sin.sizes() == in.cos.sizes(), op, ": cos/sin must be [",
              seq, ", ", head_dim, "], got ", checks::shape_str(in.cos));
  return invert_rope(in.queries.narrow(2, start, n).to(at::kFloat), in.cos.narrow(0, start, n).to(at::kFloat),
                     in.sin.narrow(0, start, n).to(at::kFloat));
}

void for_each_prerope_query_chunk(const LayerInputs& in, int64_t start, int64_t n, const char* op,
                                  const std::function<void(const at::Tensor&, int64_t)>& visit) {
  constexpr int64_t kChunkBytes = int64_t{16} << 20;
  const int64_t first_rows = std::min<int64_t>(n, 256);
  const at::Tensor first = prerope_queries(in, start, first_rows, op);  // validates the inputs
  visit(first, 0);
  const int64_t row_bytes = first.size(0) * first.size(1) * first.size(3) * 4;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, row_bytes));
  for (int64_t offset = first_rows; offset < n; offset += chunk)
    visit(prerope_queries(in, start + offset, std::min(chunk, n - offset), op), offset);
}

at::Tensor rope_inv_freq(const LayerInputs& in, const char* op) {
  checks::check_keys(op, in.keys);
  const int64_t head_dim = in.keys.size(3);
  TORCH_CHECK(head_dim % 2 == 0, op, ": head_dim must be even for RoPE, got ", head_dim);
  if (in.inv_freq.defined()) {
    TORCH_CHECK(in.inv_freq.dim() == 1 && in.inv_freq.size(0) == head_dim / 2, op, ": inv_freq must be [", head_dim / 2,
                "] ([head_dim / 2]), got ", checks::shape_str(in.inv_freq));
    return in.inv_freq.to(in.keys.device(), at::kFloat);
  }
  TORCH_CHECK(in.cos.defined() && in.sin.defined(), op,
              ": needs inv_freq (RoPE inverse frequencies) or cos/sin to derive them; got neither");
  TORCH_CHECK(
      in.cos.dim() == 2 && in.cos.size(0) >= 2 && in.cos.size(1) == head_dim && in.sin.sizes() == in.cos.sizes(), op,
      ": cos and sin must be [seq_len >= 2, ", head_dim, "] to derive inv_freq, got ", checks::shape_str(in.cos),
      " and ", checks::shape_str(in.sin));
  // Every HF frequency is below pi, so the angle at position 1 is the frequency itself.
  const at::Tensor c = in.cos[1].narrow(0, 0, head_dim / 2).to(at::kFloat);
  const at::Tensor s = in.sin[1].narrow(0, 0, head_dim / 2).to(at::kFloat);
  return at::atan2(s, c).to(in.keys.device());
}

at::Tensor average_rope_rotation(const at::Tensor& inv_freq, int64_t start, int64_t count) {
  constexpr const char* op = "average_rope_rotation";
  checks::check_rank(op, "inv_freq", inv_freq, 1, "[head_dim / 2]");
  checks::check_positive(op, "count", count);
  const int64_t dim = 2 * inv_freq.size(0);
  const at::Tensor pos = at::arange(start, start + count, inv_freq.options());
  const at::Tensor angles = pos.unsqueeze(1) * inv_freq.unsqueeze(0);        // [T, D/2]
  const at::Tensor cbar = at::cat({angles.cos(), angles.cos()}, 1).mean(0);  // [D]
  const at::Tensor sbar = at::cat({angles.sin(), angles.sin()}, 1).mean(0);
  const at::Tensor P = rotate_half(at::eye(dim, inv_freq.options())).t();  // P[:, j] = rotate_half(e_j)
  return at::diag(cbar) + sbar.unsqueeze(1) * P;
}

namespace {

// The last `window` rows of the given attentions over every key, checked against the keys:
// [B, Hq, window, S] in the attentions' dtype.
at::Tensor given_rows(const LayerInputs& in, int64_t window, const char* op) {
  const at::Tensor& a = in.attentions;
  const int64_t seq = in.keys.size(2);
  checks::check_rank(op, "attentions", a, 4, "[batch, num_heads, q_len, seq_len]");
  checks::check_same_device(op, "attentions", a, "keys", in.keys);
  TORCH_CHECK(a.size(0) == in.keys.size(0) && a.size(3) == seq, op, ": attentions must be [", in.keys.size(0),
              ", num_heads, q_len, ", seq, "] to match keys, got ", checks::shape_str(a));
  TORCH_CHECK(a.size(2) >= window, op, ": attentions must hold at least the last ", window, " query rows, got q_len ",
              a.size(2));
  return a.narrow(2, a.size(2) - window, window);
}

// The same over the first S - window keys: [B, Hq, window, S - window].
at::Tensor given_window_rows(const LayerInputs& in, int64_t window, const char* op) {
  return given_rows(in, window, op).narrow(3, 0, in.keys.size(2) - window);
}

// Causal softmax of the last w positions' queries over all S keys, float32, GQA folded into rows
// (no repeat_kv); unchecked: the callers check. -> [B, Hq, w, S]
at::Tensor causal_window_softmax(const at::Tensor& queries, const at::Tensor& keys) {
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), seq = keys.size(2), head_dim = keys.size(3);
  const int64_t heads = queries.size(1), window = queries.size(2);
  const int64_t group = heads / kv_heads;
  // Fold the query heads of a group into the row dimension: one matmul per KV head, no repeat_kv.
  const at::Tensor q = queries.to(at::kFloat).reshape({batch, kv_heads, group * window, head_dim});
  at::Tensor logits = at::matmul(q, keys.to(at::kFloat).transpose(2, 3))
                          .mul_(1.0 / std::sqrt(static_cast<double>(head_dim)))
                          .view({batch, heads, window, seq});
  // Query i sits at position seq - window + i and sees keys 0..seq - window + i.
  const at::Tensor future = at::ones({window, seq}, keys.options().dtype(at::kBool)).triu(seq - window + 1);
  logits.masked_fill_(future, -std::numeric_limits<float>::infinity());
  return at::softmax(logits, -1);
}

}  // namespace

at::Tensor window_attention_mean(const LayerInputs& in, int64_t window, const char* op) {
  checks::check_kv(op, in.keys, in.values);
  checks::check_window(op, "window_size", window, in.keys.size(2));
  if (in.attentions.defined()) return given_window_rows(in, window, op).to(at::kFloat).mean(2);
  return window_attention_mean(window_queries(in, window, op), in.keys);
}

at::Tensor window_attention(const LayerInputs& in, int64_t window, const char* op) {
  checks::check_kv(op, in.keys, in.values);
  checks::check_window(op, "window_size", window, in.keys.size(2));
  if (in.attentions.defined()) return given_window_rows(in, window, op).to(at::kFloat);
  return window_attention(window_queries(in, window, op), in.keys);
}

at::Tensor window_attention(const at::Tensor& queries, const at::Tensor& keys) {
  checks::check_window_attention("window_attention", queries, keys);
  return causal_window_softmax(queries, keys).narrow(-1, 0, keys.size(2) - queries.size(2)).contiguous();
}

at::Tensor window_probabilities(const LayerInputs& in, int64_t window, const char* op) {
  checks::check_kv(op, in.keys, in.values);
  TORCH_CHECK(window >= 1 && window <= in.keys.size(2), op, ": window must be in [1, ", in.keys.size(2),
              "] (seq_len), got ", window);
  if (in.attentions.defined()) {
    checks::check_gqa(op, in.attentions.size(1), in.keys.size(1));
    return given_rows(in, window, op).to(at::kFloat);
  }
  return causal_window_softmax(window_queries(in, window, op), in.keys);
}

at::Tensor composite::window_attention_mean(const at::Tensor& queries, const at::Tensor& keys) {
  checks::check_window_attention("window_attention_mean", queries, keys);
  return window_attention(queries, keys).mean(2);
}

at::Tensor window_attention_mean(const at::Tensor& queries, const at::Tensor& keys) {
  static const auto op =
      dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("kvpress::window_attention_mean");
  return op.call(queries, keys);
}

}  // namespace kvpress::ops

// ---- registration: torch.ops.kvpress (src/ops/library.cpp holds the library's root) ----------

namespace kvpress {

TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def("rotate_half(Tensor x) -> Tensor", &ops::rotate_half);
  m.def("apply_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &ops::apply_rope);
  m.def("invert_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");  // kernels
  m.def("group_mean(Tensor per_query_head, int num_kv_heads) -> Tensor", &ops::group_mean);
  m.def("window_attention(Tensor queries, Tensor keys) -> Tensor",
        static_cast<at::Tensor (*)(const at::Tensor&, const at::Tensor&)>(&ops::window_attention));
  m.def("window_attention_mean(Tensor queries, Tensor keys) -> Tensor");  // kernels
}

TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("invert_rope", &ops::composite::invert_rope);
  m.impl("window_attention_mean", &ops::composite::window_attention_mean);
}

}  // namespace kvpress
