// Compactor's building blocks (kvpress 0.5.5's LeverageScorePress, NonCausalAttnPress and
// CompactorPress): global z-score, blending, Gaussian sketch, ridge leverage by Cholesky,
// chunked non-causal attention column sums, across-heads selection.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "checks.h"
#include "compactor/compactor.h"
#include "kvpress/ops.h"
#include "presses/head_exchange.h"

namespace kvpress::ops {
namespace {

// kvpress: ridge added to the sketched Gram matrix before the first try, the factor applied on
// each failure and the number of tries (LeverageScorePress.chol_with_jitter(G, 1e-2, 5)).
constexpr double kRidge = 1e-2;
constexpr double kJitterGrowth = 10.0;
constexpr int kCholeskyTries = 5;

// Logit kvpress writes into the padded key columns of the last chunk.
constexpr double kPaddedKeyLogit = -1e-9;

// Cholesky factor of sym + cur * I for the smallest cur in ridge, 10 ridge, 100 ridge, ... that
// works for EVERY matrix of the batch (kvpress retries the whole batch together).
at::Tensor cholesky_with_jitter(const at::Tensor& gram, const char* op) {
  const at::Tensor eye = at::eye(gram.size(-1), gram.options());
  double jitter = kRidge;
  for (int attempt = 0; attempt < kCholeskyTries; ++attempt) {
    auto [factor, info] = at::linalg_cholesky_ex(gram + eye * jitter, /*upper=*/false);
    if (info.eq(0).all().item<bool>()) return factor;
    jitter = std::max(1e-8, jitter == 0.0 ? kRidge : kJitterGrowth * jitter);
  }
  TORCH_CHECK(false, op, ": the Cholesky factorisation of the sketched Gram matrix failed ", kCholeskyTries,
              " times (ridge up to ", kRidge * std::pow(kJitterGrowth, kCholeskyTries - 1),
              "); the keys probably hold NaN or Inf");
}

// X = (K - mean_S K) Φ, cast to float32. kvpress centres and sketches in the keys' dtype and casts
// X afterwards; in half precision we do the same, since the Gram matrix of X is ill-conditioned
// enough that a more precise X moves the leverage scores by tens of percent.
at::Tensor centred_sketch(const at::Tensor& keys, const at::Tensor& sketch) {
  return at::matmul(keys - keys.mean(2, /*keepdim=*/true), sketch.to(keys.scalar_type())).to(at::kFloat);
}

// centred_sketch of one KV head written into X, without its temporaries: `keys` ([B, 1, S, D], owned
// by the caller) are centred in place, then sketched (sketch_centred_into). The same values as
// centred_sketch. sketch [D, k] or [B, 1, D, k]; x_head [B, 1, S, k] float32.
void centred_sketch_into(at::Tensor keys, const at::Tensor& sketch, const at::Tensor& x_head) {
  keys.sub_(keys.mean(2, /*keepdim=*/true));
  sketch_centred_into(keys, sketch, x_head);
}

// ℓ_i = x_iᵀ (G + λI)⁻¹ x_i for the rows of X given G = XᵀX: G symmetrised and factorised by
// Cholesky (jitter shared by the whole batch, as kvpress), then ℓ_i = ||L⁻¹ x_i||² with
// G + λI = L Lᵀ (cholesky_leverage), which is never negative.
at::Tensor leverage_from_gram(const at::Tensor& x,     // [B, H, S, k] float32
                              const at::Tensor& gram,  // [B, H, k, k] float32
                              const char* op) {
  return cholesky_leverage(x, cholesky_with_jitter((gram + gram.transpose(2, 3)) * 0.5, op));
}

at::Tensor ridge_leverage_impl(const at::Tensor& x, const char* op) {  // [B, H, S, k] float32
  return leverage_from_gram(x, at::matmul(x.transpose(2, 3), x), op);
}

// The chunk-by-chunk core of noncausal_column_sums. `query_chunk(start, len)` returns the
// post-RoPE queries of positions [start, start + len) as [B, Hq, len, D].
at::Tensor chunked_column_sums(const at::Tensor& keys, int64_t num_heads, int64_t chunk,
                               const std::function<at::Tensor(int64_t, int64_t)>& query_chunk) {
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), seq = keys.size(2), dim = keys.size(3);
  const int64_t group = num_heads / kv_heads;
  const auto f32 = keys.options().dtype(at::kFloat);
  at::Tensor sums = at::empty({batch, num_heads, seq}, f32);
  for (int64_t start = 0; start < seq; start += chunk) {
    const int64_t len = std::min(chunk, seq - start);
    // Fold each GQA group into the row dimension: [B, Hkv, group * len, D] against the group's keys.
    // The logits in the cache dtype, then float32, as kvpress (a bfloat16 GEMM is also twice as fast).
    const at::Tensor k = keys.narrow(2, start, len);
    const at::Tensor q = query_chunk(start, len).to(k.scalar_type()).reshape({batch, kv_heads, group * len, dim});
    at::Tensor logits = at::matmul(q, k.transpose(2, 3)).to(at::kFloat);  // no 1/sqrt(D), as kvpress
    if (len < chunk) {
      // The padded last chunk, as kvpress builds it (chunk x chunk per query head): real rows see
      // the real keys and logits of -1e-9 for the pad columns; pad rows are 0 on real columns
      // and -1e-9 on pad columns.
      const at::Tensor real = logits.view({batch, kv_heads, group, len, len});
      logits = at::full({batch, kv_heads, group, chunk, chunk}, kPaddedKeyLogit, f32);
      logits.narrow(3, len, chunk - len).narrow(4, 0, len).zero_();
      logits.narrow(3, 0, len).narrow(4, 0, len).copy_(real);
    } else {
      logits = logits.view({batch, kv_heads, group, len, len});
    }
    // Softmax over the chunk's keys, then the sum over its query rows (pad rows included).
    const at::Tensor col = at::softmax(logits, -1).sum(3).narrow(-1, 0, len);  // [B, Hkv, group, len]
    sums.narrow(2, start, len).copy_(col.reshape({batch, num_heads, len}));
  }
  return sums;
}

}  // namespace

at::Tensor zscore(const at::Tensor& scores) {
  constexpr const char* op = "zscore";
  checks::check_defined(op, "scores", scores);
  TORCH_CHECK(at::isFloatingType(scores.scalar_type()), op, ": scores must be a floating tensor, got ",
              scores.scalar_type());
  const at::Tensor s = scores.to(at::kFloat);
  if (s.numel() < 2) return at::zeros_like(s);
  return (s - s.mean()) / s.std().clamp_min(kZscoreStdFloor);
}

at::Tensor blend_scores(at::TensorList scores, at::ArrayRef<double> weights, bool normalize) {
  constexpr const char* op = "blend_scores";
  TORCH_CHECK(!scores.empty(), op, ": scores must hold at least one tensor, got none");
  TORCH_CHECK(scores.size() == weights.size(), op, ": weights must hold one weight per score tensor (", scores.size(),
              "), got ", weights.size());
  at::Tensor out;
  for (size_t i = 0; i < scores.size(); ++i) {
    checks::check_rank(op, "scores", scores[i], 3, "[batch, heads, seq_len]");
    TORCH_CHECK(std::isfinite(weights[i]), op, ": weights must be finite, got ", weights[i]);
    if (i > 0) {
      TORCH_CHECK(scores[i].sizes() == scores[0].sizes(), op, ": every scores tensor must have the shape ",
                  checks::shape_str(scores[0]), ", got ", checks::shape_str(scores[i]));
      checks::check_same_device(op, "scores", scores[i], "the first scores", scores[0]);
    }
    const at::Tensor s = normalize ? zscore(scores[i]) : scores[i].to(at::kFloat);
    out = i == 0 ? s * weights[0] : out + s * weights[i];
  }
  return out;
}

at::Tensor gaussian_sketch(int64_t batch, int64_t heads, int64_t head_dim, int64_t sketch_dimension,
                           at::ScalarType dtype, at::Device device, int64_t seed) {
  constexpr const char* op = "gaussian_sketch";
  checks::check_positive(op, "sketch_dimension", sketch_dimension);
  TORCH_CHECK(checks::is_supported_float(dtype), op, ": dtype must be float32, float16 or bfloat16, got ", dtype);
  // Drawn on the CPU in the cache dtype, scaled in that dtype, like kvpress's
  // torch.randn(B, H, d, k, dtype=keys.dtype) * (1 / math.sqrt(k)) on a CPU cache.
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  at::Tensor phi;
  if (seed >= 0) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
    phi = at::randn({batch, heads, head_dim, sketch_dimension}, gen, options);
  } else {
    phi = at::randn({batch, heads, head_dim, sketch_dimension}, options);
  }
  phi = phi * (1.0 / std::sqrt(static_cast<double>(sketch_dimension)));
  return phi.to(device, at::kFloat);
}

at::Tensor sketch_keys(const at::Tensor& prerope_keys, const at::Tensor& sketch) {
  constexpr const char* op = "sketch_keys";
  checks::check_sketch(op, "prerope_keys", prerope_keys, sketch);
  at::Tensor x = at::empty({prerope_keys.size(0), prerope_keys.size(1), prerope_keys.size(2), sketch.size(-1)},
                           prerope_keys.options().dtype(at::kFloat));
  // One head at a time: the centred copy of the keys never exceeds one head.
  for (int64_t h = 0; h < prerope_keys.size(1); ++h)
    centred_sketch_into(prerope_keys.narrow(1, h, 1).clone(), sketch.dim() == 2 ? sketch : sketch.narrow(1, h, 1),
                        x.narrow(1, h, 1));
  return x;
}

std::tuple<at::Tensor, at::Tensor> sketch_prerope_keys(const at::Tensor& keys, const at::Tensor& cos,
                                                       const at::Tensor& sin, const at::Tensor& sketch) {
  static const auto op = dispatcher_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("kvpress::sketch_prerope_keys");
  return op.call(keys, cos, sin, sketch);
}

std::tuple<at::Tensor, at::Tensor> composite::sketch_prerope_keys(const at::Tensor& keys, const at::Tensor& cos,
                                                                  const at::Tensor& sin, const at::Tensor& sketch) {
  checks::check_sketch_prerope_keys(keys, cos, sin, sketch);
  const int64_t batch = keys.size(0), heads = keys.size(1), seq = keys.size(2);
  at::Tensor x = at::empty({batch, heads, seq, sketch.size(-1)}, keys.options().dtype(at::kFloat));
  const at::Tensor cos_f = cos.to(at::kFloat), sin_f = sin.to(at::kFloat);  // converted once, not per head
  // One KV head at a time: the float32 pre-RoPE keys and their centred copy never exceed one head.
  // The pre-RoPE keys are rounded to the cache dtype, then centred and sketched in it (kvpress's
  // pre-RoPE keys are in the model dtype).
  for (int64_t h = 0; h < heads; ++h)
    centred_sketch_into(invert_rope(keys.narrow(1, h, 1).to(at::kFloat), cos_f, sin_f).to(keys.scalar_type()),
                        sketch.dim() == 2 ? sketch : sketch.narrow(1, h, 1), x.narrow(1, h, 1));
  return {x, at::matmul(x.transpose(2, 3), x)};
}

at::Tensor cholesky_leverage(const at::Tensor& sketched, const at::Tensor& factor) {
  static const auto op = dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("kvpress::cholesky_leverage");
  return op.call(sketched, factor);
}

// The k x k inverse of the factor is one small triangular solve, and L⁻¹ applied to every row is a
// GEMM (kvpress's cholesky_solve does two triangular solves against all S rows, several times
// slower on the CPU).
void sketch_centred_into(const at::Tensor& centred, const at::Tensor& sketch, const at::Tensor& x_head) {
  for (int64_t b = 0; b < centred.size(0); ++b) {
    const at::Tensor phi = (sketch.dim() == 2 ? sketch : sketch[b][0]).to(centred.scalar_type());  // [D, k]
    at::Tensor x_bh = x_head[b][0];  // [S, k], contiguous rows of X
    if (centred.scalar_type() == at::kFloat)
      at::mm_out(x_bh, centred[b][0], phi);  // in float32 the GEMM writes X's rows directly
    else
      x_bh.copy_(at::mm(centred[b][0], phi));
  }
}

at::Tensor lower_triangular_inverse(const at::Tensor& factor) {
  const at::Tensor eye = at::eye(factor.size(-1), factor.options()).expand_as(factor);
  return at::linalg_solve_triangular(factor, eye, /*upper=*/false);
}

at::Tensor composite::cholesky_leverage(const at::Tensor& sketched, const at::Tensor& factor) {
  checks::check_cholesky_leverage("cholesky_leverage", sketched, factor);
  const at::Tensor inverse = lower_triangular_inverse(factor);  // [B, H, k, k]
  at::Tensor out = at::empty({sketched.size(0), sketched.size(1), sketched.size(2)}, sketched.options());
  // One head at a time so the [S, k] product stays per head.
  for (int64_t h = 0; h < sketched.size(1); ++h) {
    const at::Tensor y = at::matmul(sketched.narrow(1, h, 1), inverse.narrow(1, h, 1).transpose(2, 3));  // L⁻¹ x_i
    out.narrow(1, h, 1).copy_(y.square().sum(-1));
  }
  return out;
}

at::Tensor ridge_leverage(const at::Tensor& sketched) {
  constexpr const char* op = "ridge_leverage";
  checks::check_rank(op, "sketched", sketched, 4, "[batch, kv_heads, seq_len, sketch_dimension]");
  checks::check_non_empty(op, "sketched", sketched);
  TORCH_CHECK(sketched.scalar_type() == at::kFloat, op, ": sketched must be float32, got ", sketched.scalar_type());
  return ridge_leverage_impl(sketched, op);
}

at::Tensor sketched_leverage(const at::Tensor& prerope_keys, const at::Tensor& sketch) {
  constexpr const char* op = "sketched_leverage";
  checks::check_sketch(op, "prerope_keys", prerope_keys, sketch);
  return ridge_leverage_impl(sketch_keys(prerope_keys, sketch), op);
}

at::Tensor leverage_scores(const at::Tensor& prerope_keys, int64_t sketch_dimension, int64_t seed) {
  constexpr const char* op = "leverage_scores";
  checks::check_keys(op, prerope_keys);
  checks::check_positive(op, "sketch_dimension", sketch_dimension);
  const at::Tensor phi = gaussian_sketch(prerope_keys.size(0), prerope_keys.size(1), prerope_keys.size(3),
                                         sketch_dimension, prerope_keys.scalar_type(), prerope_keys.device(), seed);
  return sketched_leverage(prerope_keys, phi);
}

at::Tensor leverage_scores(const LayerInputs& in, int64_t sketch_dimension, int64_t seed, const char* op) {
  checks::check_keys(op, in.keys);
  checks::check_positive(op, "sketch_dimension", sketch_dimension);
  const int64_t batch = in.keys.size(0), dim = in.keys.size(3);
  const at::ScalarType dtype = in.keys.scalar_type();
  // One draw for every head, in the cache dtype (kvpress draws in the dtype of its pre-RoPE keys,
  // the model's): the same numbers as the all-heads op. On a rank's share, its heads' of the layer's.
  const at::Tensor phi = head_exchange::own_rows(
      op, "the sketch",
      gaussian_sketch(batch, head_exchange::layer_kv_heads(in), dim, sketch_dimension, dtype, in.keys.device(), seed),
      1, in);
  if (!in.cos.defined() && !in.sin.defined()) {
    // kvpress's path: keys projected for every head at once, centred and sketched at once, which
    // reproduces its numbers bit for bit in float32 (per-head slices of the strided projection
    // can reduce in another order). Extra memory: the projected and the centred keys.
    return ridge_leverage_impl(centred_sketch(prerope_keys(in, op).to(dtype), phi), op);
  }
  checks::check_defined(op, "cos", in.cos);
  checks::check_defined(op, "sin", in.sin);
  const auto [x, gram] = sketch_prerope_keys(in.keys, in.cos, in.sin, phi);
  return leverage_from_gram(x, gram, op);
}

at::Tensor noncausal_column_sums(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size) {
  static const auto op =
      dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("kvpress::noncausal_column_sums");
  return op.call(queries, keys, chunk_size);
}

at::Tensor composite::noncausal_column_sums(const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size) {
  checks::check_noncausal("noncausal_column_sums", queries, keys, chunk_size);
  return chunked_column_sums(keys, queries.size(1), chunk_size,
                             [&](int64_t start, int64_t len) { return queries.narrow(2, start, len); });
}

at::Tensor noncausal_column_sums(const LayerInputs& in, int64_t chunk_size, const char* op) {
  checks::check_keys(op, in.keys);
  checks::check_positive(op, "chunk_size", chunk_size);
  const int64_t seq = in.keys.size(2);
  if (in.queries.defined()) {
    checks::check_all_queries(op, in.queries, in.keys);
    return noncausal_column_sums(in.queries, in.keys, chunk_size);
  }
  TORCH_CHECK(in.hidden_states.defined() && in.q_proj.defined(), op,
              ": needs queries of every position, or hidden_states + q_proj + cos/sin; got none of them");
  checks::check_rank(op, "hidden_states", in.hidden_states, 3, "[batch, seq_len, hidden]");
  TORCH_CHECK(in.hidden_states.size(0) == in.keys.size(0) && in.hidden_states.size(1) == seq, op,
              ": hidden_states must be [", in.keys.size(0), ", ", seq, ", hidden] to match keys, got ",
              checks::shape_str(in.hidden_states));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"cos", in.cos}, {"sin", in.sin}}) {
    checks::check_defined(op, name, t);
    TORCH_CHECK(t.dim() == 2 && t.size(0) == seq && t.size(1) == in.keys.size(3), op, ": ", name, " must be [", seq,
                ", ", in.keys.size(3), "] ([seq_len, head_dim]), got ", checks::shape_str(t));
  }
  const int64_t heads = num_query_heads(in);
  checks::check_gqa(op, heads, in.keys.size(1));
  // One chunk of queries at a time: the queries of positions [start, start + len) are the last
  // `len` queries of the prefix [0, start + len), recomputed as window_queries does.
  return chunked_column_sums(in.keys, heads, chunk_size, [&](int64_t start, int64_t len) {
    const int64_t end = start + len;
    LayerInputs prefix = in;
    prefix.keys = in.keys.narrow(2, 0, end);
    prefix.values = at::Tensor();
    prefix.hidden_states = in.hidden_states.narrow(1, 0, end);
    prefix.cos = in.cos.narrow(0, 0, end);
    prefix.sin = in.sin.narrow(0, 0, end);
    prefix.num_heads = heads;
    return window_queries(prefix, len, op);
  });
}

at::Tensor noncausal_attention_scores(const at::Tensor& column_sums, const at::Tensor& values) {
  return zscore(noncausal_attention_pooled(column_sums, values));
}

at::Tensor noncausal_attention_pooled(const at::Tensor& column_sums, const at::Tensor& values) {
  constexpr const char* op = "noncausal_attention_scores";
  checks::check_rank(op, "column_sums", column_sums, 3, "[batch, num_heads, seq_len]");
  checks::check_rank(op, "values", values, 4, "[batch, kv_heads, seq_len, head_dim]");
  checks::check_float(op, "values", values);
  checks::check_non_empty(op, "values", values);
  checks::check_same_device(op, "values", values, "column_sums", column_sums);
  TORCH_CHECK(column_sums.size(0) == values.size(0) && column_sums.size(2) == values.size(2), op,
              ": column_sums must be [", values.size(0), ", num_heads, ", values.size(2), "] to match values, got ",
              checks::shape_str(column_sums));
  checks::check_gqa(op, column_sums.size(1), values.size(1));
  const at::Tensor per_kv_head = group_mean(column_sums.to(at::kFloat), values.size(1));
  // ||v_i|| in float32, one KV head at a time (no float32 copy of all the values).
  at::Tensor value_norms = at::empty_like(per_kv_head);
  for (int64_t h = 0; h < values.size(1); ++h)
    value_norms.narrow(1, h, 1).copy_(values.narrow(1, h, 1).to(at::kFloat).norm(2, -1));
  at::Tensor scores = per_kv_head * value_norms;
  return at::avg_pool1d(scores, {3}, {1}, {1}, /*ceil_mode=*/false, /*count_include_pad=*/true);
}

at::Tensor topk_mask_across_heads(const at::Tensor& scores, int64_t n_total) {
  constexpr const char* op = "topk_mask_across_heads";
  checks::check_rank(op, "scores", scores, 3, "[batch, heads, seq_len]");
  checks::check_non_empty(op, "scores", scores);
  TORCH_CHECK(at::isFloatingType(scores.scalar_type()), op, ": scores must be a floating tensor, got ",
              scores.scalar_type());
  const int64_t batch = scores.size(0), per_row = scores.size(1) * scores.size(2);
  TORCH_CHECK(n_total >= 1 && n_total <= per_row, op, ": n_total must be in [1, heads * seq_len (", per_row, ")], got ",
              n_total);
  checks::check_finite_scores(op, scores);
  // Stable descending sort of each batch row flattened head-major: ties go to the lower head,
  // then the lower position.
  const at::Tensor flat = scores.reshape({batch, per_row});
  const at::Tensor order = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/-1, /*descending=*/true));
  at::Tensor mask = at::zeros({batch, per_row}, scores.options().dtype(at::kBool));
  mask.scatter_(1, order.narrow(1, 0, n_total), true);
  return mask.view(scores.sizes());
}

RaggedKV gather_ragged(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& keep_mask) {
  constexpr const char* op = "gather_ragged";
  checks::check_kv(op, keys, values);
  checks::check_keep_mask(op, keep_mask, keys);
  RaggedKV out;
  out.batch = keys.size(0);
  out.kv_heads = keys.size(1);
  out.keep_mask = keep_mask;
  for (int64_t b = 0; b < out.batch; ++b) {
    for (int64_t h = 0; h < out.kv_heads; ++h) {
      const at::Tensor idx = keep_mask[b][h].nonzero().view(-1);  // ascending
      out.heads.push_back(HeadKV{keys[b][h].index_select(0, idx), values[b][h].index_select(0, idx), idx});
    }
  }
  return out;
}

}  // namespace kvpress::ops

// ---- registration: torch.ops.kvpress (src/ops/library.cpp holds the library's root) ----------

namespace kvpress {
namespace {
at::Tensor leverage_scores_op(const at::Tensor& prerope_keys, int64_t sketch_dimension, int64_t seed) {
  return ops::leverage_scores(prerope_keys, sketch_dimension, seed);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def("zscore(Tensor scores) -> Tensor", &ops::zscore);
  m.def("blend_scores(Tensor[] scores, float[] weights, bool normalize=True) -> Tensor", &ops::blend_scores);
  // Defaults are the C++ constants (python/.../ops.py reads them back from these schemas).
  m.def(c10::str("gaussian_sketch(int batch, int heads, int head_dim, int sketch_dimension, ScalarType dtype, ",
                 "Device device, int seed=", ops::kUnseeded, ") -> Tensor")
            .c_str(),
        &ops::gaussian_sketch);
  m.def("sketch_keys(Tensor prerope_keys, Tensor sketch) -> Tensor", &ops::sketch_keys);
  m.def("sketch_prerope_keys(Tensor keys, Tensor cos, Tensor sin, Tensor sketch) -> (Tensor, Tensor)");  // kernels
  m.def("cholesky_leverage(Tensor sketched, Tensor factor) -> Tensor");                                  // kernels
  m.def("ridge_leverage(Tensor sketched) -> Tensor", &ops::ridge_leverage);
  m.def("sketched_leverage(Tensor prerope_keys, Tensor sketch) -> Tensor", &ops::sketched_leverage);
  m.def(c10::str("leverage_scores(Tensor prerope_keys, int sketch_dimension=", ops::kDefaultSketchDimension,
                 ", int seed=", ops::kUnseeded, ") -> Tensor")
            .c_str(),
        &leverage_scores_op);
  m.def(c10::str("noncausal_column_sums(Tensor queries, Tensor keys, int chunk_size=", ops::kDefaultNoncausalChunkSize,
                 ") -> Tensor")
            .c_str());  // kernels
  m.def("noncausal_attention_scores(Tensor column_sums, Tensor values) -> Tensor", &ops::noncausal_attention_scores);
  m.def("topk_mask_across_heads(Tensor scores, int n_total) -> Tensor", &ops::topk_mask_across_heads);
}

TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("sketch_prerope_keys", &ops::composite::sketch_prerope_keys);
  m.impl("cholesky_leverage", &ops::composite::cholesky_leverage);
  m.impl("noncausal_column_sums", &ops::composite::noncausal_column_sums);
}

}  // namespace kvpress
