// ExpectedAttentionPress and the kvpress wrappers: KeyRerotationPress, ChunkKVPress, ChunkPress,
// BlockPress, ComposedPress.
#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "budget_helpers.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "kvpress/presses/block_press.h"
#include "kvpress/presses/chunk_press.h"
#include "kvpress/presses/chunkkv_press.h"
#include "kvpress/presses/composed_press.h"
#include "kvpress/presses/expected_attention_press.h"
#include "kvpress/presses/key_rerotation_press.h"

namespace kvpress {
namespace {

// [x1, x2] -> [-x2, x1] along the last dim (HF rotate_half).
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// RoPE inverse frequencies [D/2] float32: inputs.inv_freq, else atan2(sin[1], cos[1]) of the first
// half of the tables (every HF frequency is below pi, so the angle at position 1 is the frequency).
at::Tensor rope_inv_freq(const LayerInputs& in, int64_t head_dim, const char* op) {
  if (in.inv_freq.defined()) {
    TORCH_CHECK(in.inv_freq.dim() == 1 && in.inv_freq.size(0) == head_dim / 2, op, ": inv_freq must be [",
                head_dim / 2, "] ([head_dim / 2]), got ", checks::shape_str(in.inv_freq));
    return in.inv_freq.to(in.keys.device(), at::kFloat);
  }
  TORCH_CHECK(in.cos.defined() && in.sin.defined(), op,
              ": needs inv_freq (RoPE inverse frequencies) or cos/sin to derive them; got neither");
  TORCH_CHECK(in.cos.dim() == 2 && in.cos.size(0) >= 2 && in.cos.size(1) == head_dim && in.sin.sizes() == in.cos.sizes(),
              op, ": cos and sin must be [seq_len >= 2, ", head_dim, "] to derive inv_freq, got ",
              checks::shape_str(in.cos), " and ", checks::shape_str(in.sin));
  const at::Tensor c = in.cos[1].narrow(0, 0, head_dim / 2).to(at::kFloat);
  const at::Tensor s = in.sin[1].narrow(0, 0, head_dim / 2).to(at::kFloat);
  return at::atan2(s, c).to(in.keys.device());
}

// Pre-RoPE queries of positions [start, start + n), float32 [B, Hq, n, D].
at::Tensor prerope_queries(const LayerInputs& in, int64_t start, int64_t n, const char* op) {
  const int64_t batch = in.keys.size(0), seq = in.keys.size(2), head_dim = in.keys.size(3);
  if (in.hidden_states.defined() && in.q_proj.defined()) {
    const at::Tensor& h = in.hidden_states;
    checks::check_rank(op, "hidden_states", h, 3, "[batch, seq_len, hidden]");
    TORCH_CHECK(h.size(0) == batch && h.size(1) == seq, op, ": hidden_states must be [", batch, ", ", seq,
                ", hidden] to match keys, got ", checks::shape_str(h));
    checks::check_same_device(op, "hidden_states", h, "keys", in.keys);
    const int64_t heads = ops::num_query_heads(in);
    checks::check_rank(op, "q_proj", in.q_proj, 2, "[heads * head_dim, hidden]");
    TORCH_CHECK(in.q_proj.size(0) == heads * head_dim && in.q_proj.size(1) == h.size(2), op, ": q_proj must be [",
                heads * head_dim, ", ", h.size(2), "], got ", checks::shape_str(in.q_proj));
    checks::check_same_device(op, "q_proj", in.q_proj, "hidden_states", h);
    at::Tensor q = at::matmul(h.narrow(1, start, n).to(at::kFloat), in.q_proj.to(at::kFloat).t())
                       .view({batch, n, heads, head_dim})
                       .transpose(1, 2);
    if (in.q_norm.defined()) {
      TORCH_CHECK(in.q_norm.dim() == 1 && in.q_norm.size(0) == head_dim, op, ": q_norm must be [", head_dim,
                  "] ([head_dim]), got ", checks::shape_str(in.q_norm));
      q = q * at::rsqrt(q.pow(2).mean(-1, true) + in.norm_eps) * in.q_norm.to(at::kFloat);
    }
    return q;
  }
  TORCH_CHECK(in.queries.defined() && in.cos.defined() && in.sin.defined(), op,
              ": needs hidden_states + q_proj, or queries of all positions + cos/sin; got neither");
  checks::check_rank(op, "queries", in.queries, 4, "[batch, num_heads, seq_len, head_dim]");
  TORCH_CHECK(in.queries.size(0) == batch && in.queries.size(2) == seq && in.queries.size(3) == head_dim, op,
              ": queries must cover all positions, [", batch, ", num_heads, ", seq, ", ", head_dim, "], got ",
              checks::shape_str(in.queries));
  TORCH_CHECK(in.cos.dim() == 2 && in.cos.size(0) == seq && in.sin.sizes() == in.cos.sizes(), op,
              ": cos/sin must be [", seq, ", ", head_dim, "], got ", checks::shape_str(in.cos));
  return ops::invert_rope(in.queries.narrow(2, start, n).to(at::kFloat), in.cos.narrow(0, start, n).to(at::kFloat),
                          in.sin.narrow(0, start, n).to(at::kFloat));
}

void check_inner(const char* op, const void* press) {
  TORCH_CHECK(press != nullptr, op, ": press must be a ScorerPress, got nullptr");
}

// Hq when it is known (num_heads, queries, attentions or q_proj), else 0 (infer later).
int64_t heads_or_zero(const LayerInputs& in) {
  if (in.num_heads > 0 || in.queries.defined() || in.attentions.defined() || in.q_proj.defined()) {
    try {
      return ops::num_query_heads(in);
    } catch (const c10::Error&) {
      return 0;
    }
  }
  return 0;
}

// Only keys/values (and the bookkeeping scalars) of `in`.
LayerInputs kv_only(const LayerInputs& in, const at::Tensor& keys, const at::Tensor& values) {
  LayerInputs out;
  out.keys = keys;
  out.values = values;
  out.num_heads = heads_or_zero(in);
  out.layer_idx = in.layer_idx;
  out.num_layers = in.num_layers;
  out.inv_freq = in.inv_freq;
  return out;
}

}  // namespace

// ---- ExpectedAttentionPress -----------------------------------------------------------------

ExpectedAttentionPress::ExpectedAttentionPress(double compression_ratio, int64_t n_future_positions, int64_t n_sink,
                                               bool use_covariance, bool use_vnorm, double epsilon)
    : ScorerPress(compression_ratio),
      n_future_positions_(n_future_positions),
      n_sink_(n_sink),
      use_covariance_(use_covariance),
      use_vnorm_(use_vnorm),
      epsilon_(epsilon) {
  checks::check_positive("ExpectedAttentionPress", "n_future_positions", n_future_positions);
  checks::check_non_negative("ExpectedAttentionPress", "n_sink", n_sink);
  TORCH_CHECK(std::isfinite(epsilon) && epsilon >= 0, "ExpectedAttentionPress: epsilon must be >= 0, got ", epsilon);
}

at::Tensor ExpectedAttentionPress::score(const LayerInputs& in) const {
  constexpr const char* op = "ExpectedAttentionPress";
  checks::check_kv(op, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  TORCH_CHECK(seq > n_sink_, op, ": seq_len must be > n_sink (", n_sink_, "), got ", seq);
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even for RoPE, got ", d);
  const int64_t n = seq - n_sink_;

  // Query statistics over positions n_sink..S-1 (mean, biased covariance), accumulated over
  // chunks of positions so that no more than one chunk of queries exists at a time (the queries
  // of every position are Hq / Hkv times the size of K). Sums are shifted by the first chunk's
  // mean, for accuracy, and carried in float64 across chunks.
  const int64_t first_rows = std::min<int64_t>(n, 256);
  const at::Tensor first = prerope_queries(in, n_sink_, first_rows, op);  // [B, Hq, first_rows, D]
  const int64_t heads = first.size(1);
  checks::check_gqa(op, heads, kv_heads);
  const int64_t group = heads / kv_heads;
  const at::Tensor shift = first.mean(2, true);  // [B, Hq, 1, D]
  const int64_t chunk = std::max<int64_t>(1, (int64_t{16} << 20) / std::max<int64_t>(1, batch * heads * d * 4));
  at::Tensor sum = at::zeros({batch, heads, d}, first.options().dtype(at::kDouble));
  at::Tensor second = use_covariance_ ? at::zeros({batch, heads, d, d}, sum.options()) : at::Tensor();
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t rows = std::min(chunk, n - start);
    const at::Tensor qc = prerope_queries(in, n_sink_ + start, rows, op) - shift;  // [B, Hq, rows, D]
    sum += qc.sum(2).to(at::kDouble);
    if (use_covariance_) second += at::matmul(qc.transpose(2, 3), qc).to(at::kDouble);
  }
  const at::Tensor mean_shifted = sum / static_cast<double>(n);               // [B, Hq, D] float64
  at::Tensor mu = (shift.squeeze(2).to(at::kDouble) + mean_shifted).to(at::kFloat);

  // R̄ = mean over the future positions of cos_t·I + sin_t·P (P: rotate_half as a matrix).
  const at::Tensor inv_freq = rope_inv_freq(in, d, op);  // [D/2]
  const at::Tensor pos = at::arange(seq, seq + n_future_positions_, inv_freq.options());
  const at::Tensor angles = pos.unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, D/2]
  const at::Tensor cbar = at::cat({angles.cos(), angles.cos()}, 1).mean(0);  // [D]
  const at::Tensor sbar = at::cat({angles.sin(), angles.sin()}, 1).mean(0);
  // R̄x = x·c̄ + rotate_half(x)·s̄, so R̄ = diag(c̄) + diag(s̄)·P with P the matrix of rotate_half.
  const at::Tensor eye = at::eye(d, inv_freq.options());
  const at::Tensor P = rotate_half(eye).t();  // P[:, j] = rotate_half(e_j)
  const at::Tensor R = at::diag(cbar) + sbar.unsqueeze(1) * P;  // [D, D]

  mu = at::matmul(mu, R.t());  // [B, Hq, D]
  const at::Tensor k = in.keys.narrow(2, n_sink_, n).to(at::kFloat);  // [B, Hkv, n, D]
  // Fold each group's query heads into a matmul with its KV head: [B, Hkv, n, G].
  at::Tensor z = at::matmul(k, mu.view({batch, kv_heads, group, d}).transpose(2, 3)) / std::sqrt(double(d));
  if (use_covariance_) {
    const at::Tensor outer = mean_shifted.unsqueeze(-1) * mean_shifted.unsqueeze(-2);  // [B, Hq, D, D]
    at::Tensor cov = (second / static_cast<double>(n) - outer).to(at::kFloat);
    cov = at::matmul(R, at::matmul(cov, R.t())).view({batch, kv_heads, group, d, d});
    // k_iᵀ Σ'_h k_i for every query head h of the group, one chunk of keys at a time
    // ([B, Hkv, G, rows, D] per chunk, the size of a query chunk, instead of G times the keys).
    std::vector<at::Tensor> quads;
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t rows = std::min(chunk, n - start);
      const at::Tensor kc = k.narrow(2, start, rows).unsqueeze(2);           // [B, Hkv, 1, rows, D]
      quads.push_back((at::matmul(kc, cov) * kc).sum(-1));                   // [B, Hkv, G, rows]
    }
    z = z + at::cat(quads, 3).transpose(2, 3) / static_cast<double>(d) / 2.0;
  }
  at::Tensor s = at::softmax(z, 2).mean(3);  // softmax over positions per query head, group mean -> [B, Hkv, n]
  if (use_vnorm_) s = (s + epsilon_) * at::linalg_vector_norm(in.values.narrow(2, n_sink_, n).to(at::kFloat), 2, {-1});
  if (n_sink_ == 0) return s.contiguous();
  const double pad = s.max().item<double>() + 1.0;
  return at::cat({at::full({batch, kv_heads, n_sink_}, pad, s.options()), s}, 2).contiguous();
}

// ---- KeyRerotationPress -------------------------------------------------------------------

KeyRerotationPress::KeyRerotationPress(std::shared_ptr<const ScorerPress> press) : press_(std::move(press)) {
  check_inner("KeyRerotationPress", press_.get());
}

KV KeyRerotationPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "KeyRerotationPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (press_->compression_ratio() == 0.0) return budget::keep_all(in);
  const int64_t seq = in.keys.size(2), d = in.keys.size(3);
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even for RoPE, got ", d);
  const at::Tensor inv_freq = rope_inv_freq(in, d, op);
  const at::Tensor scores = budget::inner_scores(*press_, in, op);
  KV kv = ops::gather_kv(in.keys, in.values, ops::topk_indices(scores, ops::n_kept(seq, press_->compression_ratio())));
  // Δ = new slot - old position, angles in float32; products in the cache dtype (as kvpress).
  // One (batch row, KV head) at a time, in place: the temporaries stay a head's size instead of
  // several float32 copies of all kept keys.
  const int64_t n = kv.kept_indices.size(2);
  const at::Tensor slot = at::arange(n, inv_freq.options());
  const auto dt = kv.keys.scalar_type();
  for (int64_t b = 0; b < kv.keys.size(0); ++b) {
    for (int64_t h = 0; h < kv.keys.size(1); ++h) {
      at::Tensor head = kv.keys[b][h];                                             // [n, D] view
      const at::Tensor delta = slot - kv.kept_indices[b][h].to(at::kFloat);         // [n]
      const at::Tensor freqs = delta.unsqueeze(-1) * inv_freq;                      // [n, D/2]
      const at::Tensor emb = at::cat({freqs, freqs}, -1);                           // [n, D]
      head.copy_(head * emb.cos().to(dt) + rotate_half(head) * emb.sin().to(dt));
    }
  }
  return kv;
}

// ---- ChunkKVPress ---------------------------------------------------------------------------

ChunkKVPress::ChunkKVPress(std::shared_ptr<const ScorerPress> press, int64_t chunk_length)
    : press_(std::move(press)), chunk_length_(chunk_length) {
  check_inner("ChunkKVPress", press_.get());
  checks::check_positive("ChunkKVPress", "chunk_length", chunk_length);
}

KV ChunkKVPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "ChunkKVPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (press_->compression_ratio() == 0.0) return budget::keep_all(in);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t n_full = seq / chunk_length_, rest = seq % chunk_length_;
  LayerInputs no_attn = in;
  no_attn.attentions = at::Tensor();  // kvpress refuses attentions; we do not pass them on
  if (n_full == 0) return press_->compress(no_attn);
  const at::Tensor scores = budget::inner_scores(*press_, no_attn, op).to(at::kFloat).sum(1);  // [B, S]
  std::vector<at::Tensor> chunk_scores{scores.narrow(1, 0, n_full * chunk_length_).view({batch, n_full, chunk_length_}).mean(-1)};
  if (rest > 0) chunk_scores.push_back(scores.narrow(1, seq - rest, rest).mean(-1, true));
  const at::Tensor per_chunk = at::cat(chunk_scores, 1).sum(0).view({1, 1, -1});  // summed over the batch
  const int64_t n_chunks = per_chunk.size(2);
  const int64_t n_keep = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(n_chunks) * (1.0 - press_->compression_ratio())));
  const at::Tensor chunks = ops::topk_indices(per_chunk, n_keep).flatten();  // ascending
  // Chunk c covers [c·chunk_length, min((c+1)·chunk_length, S)).
  const at::Tensor pos = at::arange(seq, in.keys.options().dtype(at::kLong));
  const at::Tensor keep = at::isin(pos.div(chunk_length_, "floor"), chunks.to(pos.device()));
  const at::Tensor kept = pos.masked_select(keep);
  return ops::gather_kv(in.keys, in.values, kept.view({1, 1, -1}).expand({batch, kv_heads, kept.size(0)}).contiguous());
}

// ---- ChunkPress ------------------------------------------------------------------------------

ChunkPress::ChunkPress(std::shared_ptr<const ScorerPress> press, int64_t chunk_length)
    : press_(std::move(press)), chunk_length_(chunk_length) {
  check_inner("ChunkPress", press_.get());
  checks::check_positive("ChunkPress", "chunk_length", chunk_length);
}

KV ChunkPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "ChunkPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (press_->compression_ratio() == 0.0) return budget::keep_all(in);
  const int64_t seq = in.keys.size(2);
  std::vector<at::Tensor> kept;
  for (int64_t start = 0; start < seq; start += chunk_length_) {
    const int64_t len = std::min(chunk_length_, seq - start);
    LayerInputs sub = in;
    sub.attentions = at::Tensor();  // kvpress refuses attentions; we do not pass them on
    sub.keys = in.keys.narrow(2, start, len);
    sub.values = in.values.narrow(2, start, len);
    sub.num_heads = heads_or_zero(in);
    if (in.hidden_states.defined()) sub.hidden_states = in.hidden_states.narrow(1, start, len);
    if (in.queries.defined()) {
      TORCH_CHECK(in.queries.dim() == 4 && in.queries.size(2) == seq, op,
                  ": queries must cover all positions ([batch, num_heads, ", seq, ", head_dim]), got ",
                  checks::shape_str(in.queries));
      sub.queries = in.queries.narrow(2, start, len);
    }
    // kvpress hands the full tables to the inner press, whose window reads their tail.
    if (in.cos.defined() && in.cos.dim() == 2 && in.cos.size(0) >= len) sub.cos = in.cos.narrow(0, in.cos.size(0) - len, len);
    if (in.sin.defined() && in.sin.dim() == 2 && in.sin.size(0) >= len) sub.sin = in.sin.narrow(0, in.sin.size(0) - len, len);
    const at::Tensor scores = budget::inner_scores(*press_, sub, op);
    kept.push_back(ops::topk_indices(scores, ops::n_kept(len, press_->compression_ratio())) + start);
  }
  return ops::gather_kv(in.keys, in.values, at::cat(kept, -1).contiguous());
}

// ---- BlockPress ------------------------------------------------------------------------------

BlockPress::BlockPress(std::shared_ptr<const ScorerPress> press, int64_t block_size)
    : press_(std::move(press)), block_size_(block_size) {
  check_inner("BlockPress", press_.get());
  checks::check_positive("BlockPress", "block_size", block_size);
}

KV BlockPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "BlockPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (press_->compression_ratio() == 0.0) return budget::keep_all(in);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  const int64_t block = std::min(block_size_, seq);
  const int64_t n_kept = ops::n_kept(seq, press_->compression_ratio());
  const auto long_opts = in.keys.options().dtype(at::kLong);
  at::Tensor kept = at::arange(n_kept, long_opts).expand({batch, kv_heads, n_kept});
  for (int64_t start = n_kept; start < seq; start += block) {
    const int64_t end = std::min(start + block, seq);
    const at::Tensor cand =
        at::cat({kept, at::arange(start, end, long_opts).expand({batch, kv_heads, end - start})}, -1).contiguous();
    const at::Tensor idx = cand.unsqueeze(-1).expand({-1, -1, -1, d});
    const LayerInputs sub = kv_only(in, in.keys.gather(2, idx), in.values.gather(2, idx));
    const at::Tensor scores = budget::inner_scores(*press_, sub, op);
    kept = cand.gather(-1, ops::topk_indices(scores, n_kept));
  }
  return ops::gather_kv(in.keys, in.values, std::get<0>(kept.sort(-1)).contiguous());
}

// ---- ComposedPress --------------------------------------------------------------------------

ComposedPress::ComposedPress(std::vector<std::shared_ptr<const BasePress>> presses) : presses_(std::move(presses)) {
  TORCH_CHECK(!presses_.empty(), "ComposedPress: presses must hold at least one press, got none");
  for (size_t i = 0; i < presses_.size(); ++i)
    TORCH_CHECK(presses_[i] != nullptr, "ComposedPress: presses[", i, "] must be a press, got nullptr");
}

double ComposedPress::compression_ratio() const {
  double kept = 1.0;
  for (const auto& p : presses_) kept *= 1.0 - p->compression_ratio();
  return 1.0 - kept;
}

KV ComposedPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "ComposedPress.compress";
  checks::check_kv(op, in.keys, in.values);
  KV kv = presses_.front()->compress(in);
  for (size_t i = 1; i < presses_.size(); ++i) {
    const KV next = presses_[i]->compress(kv_only(in, kv.keys, kv.values));
    kv = KV{next.keys, next.values, kv.kept_indices.gather(-1, next.kept_indices).contiguous()};
  }
  return kv;
}

}  // namespace kvpress
