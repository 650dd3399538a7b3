// Score ops of the first presses. Each follows kvpress 0.5.5's formula; see docs/PRESS_NOTES.md.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "checks.h"
#include "kvpress/ops.h"
#include "scores/scores.h"

namespace kvpress::ops {
namespace {

// Appends `count` entries equal to max(scores) + 1 along the last dim, so those positions are
// always kept (kvpress pads SnapKV's window and TOVA's last token this way).
at::Tensor pad_with_max_plus_one(const at::Tensor& scores, int64_t count) {
  const double fill = scores.max().item<double>() + 1.0;
  std::vector<int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = count;
  return at::cat({scores, at::full(shape, fill, scores.options())}, -1);
}

// LagKV's per-partition statistic: normalise partition p by the per-channel min/max of
// partition p + 1, take the std over channels, softmax over the partition's tokens.
at::Tensor lag_relative_scores(const at::Tensor& partitions) {  // [B, H, P, lag, D] float
  const int64_t p = partitions.size(2);
  const at::Tensor ref = partitions.narrow(2, 1, p - 1);
  const at::Tensor cur = partitions.narrow(2, 0, p - 1);
  const at::Tensor lo = std::get<0>(ref.min(-2, /*keepdim=*/true));
  const at::Tensor hi = std::get<0>(ref.max(-2, /*keepdim=*/true));
  return ((cur - lo) / (hi - lo)).std(-1, /*unbiased=*/true).softmax(-1);  // [B, H, P-1, lag]
}

}  // namespace

at::Tensor composite::lagkv_partition_scores(const at::Tensor& keys, const at::Tensor& values, int64_t n_sink,
                                             int64_t lag_size, bool cross_scoring) {
  constexpr const char* op = "lagkv_partition_scores";
  checks::check_lagkv_partitions(op, keys, values, n_sink, lag_size);
  const int64_t batch = keys.size(0), heads = keys.size(1), seq = keys.size(2), dim = keys.size(3);
  const checks::LagLayout layout = checks::lag_layout(seq, n_sink, lag_size);
  const auto float_opts = keys.options().dtype(at::kFloat);
  auto partitions = [&](const at::Tensor& x) {
    return x.narrow(2, n_sink, layout.end - n_sink)
        .to(at::kFloat)
        .reshape({batch, heads, layout.n_parts, lag_size, dim});
  };
  at::Tensor scores = (lag_relative_scores(partitions(keys)) + lag_relative_scores(partitions(values))) / 2;
  if (!cross_scoring) {
    // Rank within each partition, scaled to [0, 1).
    const at::Tensor order = scores.argsort(/*stable=*/true, -1);
    scores = (order.argsort(/*stable=*/true, -1).to(at::kFloat) / static_cast<double>(lag_size))
                 .to(keys.scalar_type())
                 .to(at::kFloat);
  }
  return at::cat({at::ones({batch, heads, n_sink}, float_opts), scores.reshape({batch, heads, -1}),
                  at::ones({batch, heads, layout.tail_len}, float_opts)},
                 -1);
}

namespace {

using KeysToScoresOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)>;

// A keys -> scores op through the dispatcher; undefined keys would dispatch nowhere, so they are
// named first.
at::Tensor call_keys_op(const KeysToScoresOp& op, const char* name, const at::Tensor& keys) {
  checks::check_defined(name, "keys", keys);
  return op.call(keys);
}

}  // namespace

at::Tensor key_norm_scores(const at::Tensor& keys) {
  static const KeysToScoresOp op = dispatcher_op<at::Tensor(const at::Tensor&)>("kvpress::key_norm_scores");
  return call_keys_op(op, "key_norm_scores", keys);
}

at::Tensor composite::key_norm_scores(const at::Tensor& keys) {
  checks::check_keys("key_norm_scores", keys);
  return -at::linalg_vector_norm(keys.to(at::kFloat), 2, {-1});
}

at::Tensor keydiff_scores(const at::Tensor& keys) {
  static const KeysToScoresOp op = dispatcher_op<at::Tensor(const at::Tensor&)>("kvpress::keydiff_scores");
  return call_keys_op(op, "keydiff_scores", keys);
}

at::Tensor composite::keydiff_scores(const at::Tensor& keys) {
  checks::check_keys("keydiff_scores", keys);
  const at::Tensor k = keys.to(at::kFloat);
  // F.normalize (eps 1e-12), sequence mean, then F.cosine_similarity (eps 1e-8).
  const at::Tensor unit = k / k.norm(2, -1, /*keepdim=*/true).clamp_min(1e-12);
  const at::Tensor anchor = unit.mean(2, /*keepdim=*/true);
  return -at::cosine_similarity(k, anchor, -1, 1e-8);
}

at::Tensor rescue_column_max(const at::Tensor& logits, double scale) {
  static const auto op = dispatcher_op<at::Tensor(const at::Tensor&, double)>("kvpress::rescue_column_max");
  checks::check_defined("rescue_column_max", "logits", logits);
  return op.call(logits, scale);
}

at::Tensor composite::rescue_column_max(const at::Tensor& logits, double scale) {
  checks::check_rescue_logits("rescue_column_max", logits, scale);
  const at::Tensor l = logits / scale;
  return (l - at::logsumexp(l, 1, /*keepdim=*/true)).amax(0);
}

std::tuple<at::Tensor, at::Tensor> max_similarity(const at::Tensor& rows, const at::Tensor& candidates) {
  static const auto op = dispatcher_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>(
      "kvpress::max_similarity");
  checks::check_defined("max_similarity", "rows", rows);
  checks::check_defined("max_similarity", "candidates", candidates);
  return op.call(rows, candidates);
}

std::tuple<at::Tensor, at::Tensor> composite::max_similarity(const at::Tensor& rows, const at::Tensor& candidates) {
  checks::check_similarity_rows("max_similarity", rows, candidates);
  // Rows a block at a time, so that the [rows, m] similarities stay under 4M floats (16 MiB).
  constexpr int64_t kMaxSimilarityElements = int64_t{1} << 22;
  const int64_t n = rows.size(2), per_row = rows.size(0) * rows.size(1) * candidates.size(2);
  const int64_t block = std::max<int64_t>(1, kMaxSimilarityElements / std::max<int64_t>(1, per_row));
  const at::Tensor candidates_t = candidates.transpose(-1, -2);
  std::vector<at::Tensor> values, indices;
  for (int64_t r0 = 0; r0 < n; r0 += block) {
    auto [v, i] = at::matmul(rows.narrow(2, r0, std::min(block, n - r0)), candidates_t).max(-1);
    values.push_back(v);
    indices.push_back(i);
  }
  if (n == 0)
    return {at::empty({rows.size(0), rows.size(1), 0}, rows.options()),
            at::empty({rows.size(0), rows.size(1), 0}, rows.options().dtype(at::kLong))};
  return {at::cat(values, 2), at::cat(indices, 2)};
}

at::Tensor output_projected_l1_norms(const at::Tensor& values, const at::Tensor& o_proj, int64_t num_heads) {
  static const auto op =
      dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("kvpress::output_projected_l1_norms");
  checks::check_defined("output_projected_l1_norms", "values", values);
  return op.call(values, o_proj, num_heads);
}

at::Tensor composite::output_projected_l1_norms(const at::Tensor& values, const at::Tensor& o_proj, int64_t num_heads) {
  checks::check_output_projection("output_projected_l1_norms", values, o_proj, num_heads);
  const int64_t batch = values.size(0), kv_heads = values.size(1), seq = values.size(2), d = values.size(3);
  const int64_t hidden = o_proj.size(0), groups = num_heads / kv_heads;
  // Rows of v W_o evaluated at once: the [rows, G·hidden] product stays under 4M floats (16 MiB).
  constexpr int64_t kMaxProductElements = int64_t{1} << 22;
  const int64_t block = std::max<int64_t>(1, kMaxProductElements / (groups * hidden * std::max<int64_t>(batch, 1)));
  std::vector<at::Tensor> per_head;
  per_head.reserve(static_cast<size_t>(kv_heads));
  for (int64_t j = 0; j < kv_heads; ++j) {
    // Query heads j·G .. j·G+G-1 read KV head j (repeat_kv); their W_o^h side by side: [D, G·hidden].
    const at::Tensor w = o_proj.narrow(1, j * groups * d, groups * d)
                             .to(at::kFloat)
                             .view({hidden, groups, d})
                             .permute({2, 1, 0})
                             .reshape({d, groups * hidden});
    const at::Tensor v = values.select(1, j).to(at::kFloat);  // [B, S, D]
    std::vector<at::Tensor> blocks;
    for (int64_t start = 0; start < seq; start += block) {
      const int64_t n = std::min(block, seq - start);
      const at::Tensor prod = at::matmul(v.narrow(1, start, n), w).view({batch, n, groups, hidden});
      // L1 over hidden in one reduction (no |prod| temporary), mean over the group: [B, n].
      blocks.push_back(at::linalg_vector_norm(prod, 1, {-1}).mean(-1));
    }
    per_head.push_back(seq > 0 ? at::cat(blocks, 1) : at::zeros({batch, 0}, values.options().dtype(at::kFloat)));
  }
  return at::stack(per_head, 1);  // [B, Hkv, S]
}

at::Tensor streaming_llm_scores(const at::Tensor& keys, int64_t n_sink, double compression_ratio) {
  constexpr const char* op = "streaming_llm_scores";
  checks::check_keys(op, keys);
  checks::check_ratio(op, compression_ratio);
  checks::check_non_negative(op, "n_sink", n_sink);
  const int64_t seq = keys.size(2);
  TORCH_CHECK(n_sink < seq, op, ": n_sink must be < seq_len (", seq, "), got ", n_sink);
  const int64_t n_pruned = seq - static_cast<int64_t>(static_cast<double>(seq) * (1.0 - compression_ratio));
  at::Tensor scores = at::ones({keys.size(0), keys.size(1), seq}, keys.options().dtype(at::kFloat));
  scores.narrow(2, n_sink, std::min(n_pruned, seq - n_sink)).zero_();
  return scores;
}

at::Tensor random_scores(const at::Tensor& keys, int64_t seed) {
  checks::check_keys("random_scores", keys);
  const auto options = keys.options().device(at::kCPU);
  at::Tensor scores;
  if (seed >= 0) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
    scores = at::rand({keys.size(0), keys.size(1), keys.size(2)}, gen, options);
  } else {
    scores = at::rand({keys.size(0), keys.size(1), keys.size(2)}, options);
  }
  return scores.to(keys.device(), at::kFloat);
}

at::Tensor lagkv_scores(const at::Tensor& keys, const at::Tensor& values, int64_t n_sink, int64_t lag_size,
                        bool cross_scoring) {
  constexpr const char* op = "lagkv_scores";
  checks::check_kv(op, keys, values);
  checks::check_non_negative(op, "n_sink", n_sink);
  checks::check_positive(op, "lag_size", lag_size);
  const int64_t batch = keys.size(0), heads = keys.size(1), seq = keys.size(2);
  const auto float_opts = keys.options().dtype(at::kFloat);
  if (seq < n_sink + 2 * lag_size) {
    // Too short to compare partitions: keep sinks, then rank tokens by recency.
    at::Tensor scores = at::ones({batch, heads, seq}, float_opts);
    if (seq > n_sink) {
      const at::Tensor ramp = at::arange(seq - n_sink, float_opts) / static_cast<double>(seq - n_sink);
      // kvpress rounds the ramp to the cache dtype.
      scores.narrow(2, n_sink, seq - n_sink).copy_(ramp.to(keys.scalar_type()));
    }
    return scores;
  }
  // The partition statistics run in one fused pass (src/ops/scores/cpu/lagkv.cpp, src/ops/scores/cuda/lagkv.cu).
  static const auto partition_scores =
      dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>(
          "kvpress::lagkv_partition_scores");
  return partition_scores.call(keys, values, n_sink, lag_size, cross_scoring);
}

at::Tensor snapkv_scores(const at::Tensor& window_attn, int64_t num_kv_heads, int64_t kernel_size) {
  constexpr const char* op = "snapkv_scores";
  checks::check_rank(op, "window_attn", window_attn, 4, "[batch, num_heads, window, seq_len - window]");
  checks::check_non_empty(op, "window_attn", window_attn);
  checks::check_gqa(op, window_attn.size(1), num_kv_heads);
  TORCH_CHECK(kernel_size > 0 && kernel_size % 2 == 1, op, ": kernel_size must be a positive odd number, got ",
              kernel_size);
  // Mean over the window queries first.
  return snapkv_scores_from_mean(window_attn.to(at::kFloat).mean(2), num_kv_heads, kernel_size, window_attn.size(2));
}

at::Tensor snapkv_scores_from_mean(const at::Tensor& mean_attn, int64_t num_kv_heads, int64_t kernel_size,
                                   int64_t window_size) {
  constexpr const char* op = "snapkv_scores_from_mean";
  checks::check_rank(op, "mean_attn", mean_attn, 3, "[batch, num_heads, seq_len - window]");
  checks::check_non_empty(op, "mean_attn", mean_attn);
  checks::check_gqa(op, mean_attn.size(1), num_kv_heads);
  checks::check_positive(op, "window_size", window_size);
  TORCH_CHECK(kernel_size > 0 && kernel_size % 2 == 1, op, ": kernel_size must be a positive odd number, got ",
              kernel_size);
  // A zero-padded moving average that counts the padding.
  at::Tensor scores = at::avg_pool1d(mean_attn.to(at::kFloat), {kernel_size}, {1}, {kernel_size / 2},
                                     /*ceil_mode=*/false, /*count_include_pad=*/true);
  scores = group_mean(scores, num_kv_heads);
  return pad_with_max_plus_one(scores, window_size);
}

at::Tensor tova_scores(const at::Tensor& last_attn, int64_t num_kv_heads) {
  constexpr const char* op = "tova_scores";
  checks::check_rank(op, "last_attn", last_attn, 4, "[batch, num_heads, 1, seq_len - 1]");
  checks::check_non_empty(op, "last_attn", last_attn);
  TORCH_CHECK(last_attn.size(2) == 1, op, ": last_attn must hold one query row, got ", checks::shape_str(last_attn));
  checks::check_gqa(op, last_attn.size(1), num_kv_heads);
  // One score row for all KV heads: the mean over every query head.
  const at::Tensor scores = last_attn.to(at::kFloat).mean(1).expand({-1, num_kv_heads, -1});
  return pad_with_max_plus_one(scores.contiguous(), 1);
}

at::Tensor observed_attention_scores(const at::Tensor& attentions, int64_t num_kv_heads) {
  constexpr const char* op = "observed_attention_scores";
  checks::check_rank(op, "attentions", attentions, 4, "[batch, num_heads, seq_len, seq_len]");
  checks::check_non_empty(op, "attentions", attentions);
  const int64_t seq = attentions.size(3);
  TORCH_CHECK(attentions.size(2) == seq, op, ": attentions must cover every query position ([batch, num_heads, ", seq,
              ", ", seq, "]), got ", checks::shape_str(attentions));
  checks::check_gqa(op, attentions.size(1), num_kv_heads);
  // Key i is seen by the seq - i queries at or after it.
  const at::Tensor seen_by = at::arange(seq, 0, -1, attentions.options().dtype(at::kFloat));
  return group_mean(attentions.to(at::kFloat).sum(2) / seen_by, num_kv_heads);
}

}  // namespace kvpress::ops

// ---- registration: torch.ops.kvpress (src/ops/library.cpp holds the library's root) ----------

namespace kvpress {
namespace {
at::Tensor random_scores_op(const at::Tensor& keys, int64_t seed) { return ops::random_scores(keys, seed); }
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def("key_norm_scores(Tensor keys) -> Tensor");  // kernels
  m.def("keydiff_scores(Tensor keys) -> Tensor");   // kernels
  m.def("streaming_llm_scores(Tensor keys, int n_sink, float compression_ratio) -> Tensor", &ops::streaming_llm_scores);
  // Defaults are the C++ constants (python/.../ops.py reads them back from these schemas).
  m.def(c10::str("random_scores(Tensor keys, int seed=", ops::kUnseeded, ") -> Tensor").c_str(), &random_scores_op);
  m.def("lagkv_scores(Tensor keys, Tensor values, int n_sink, int lag_size, bool cross_scoring) -> Tensor",
        &ops::lagkv_scores);
  // lagkv_scores' partition statistics for seq_len >= n_sink + 2 * lag_size (kernels).
  m.def("lagkv_partition_scores(Tensor keys, Tensor values, int n_sink, int lag_size, bool cross_scoring) -> Tensor");
  // CTRPress's rescue: each key's largest softmax log-weight over rows of logits / scale (kernels).
  m.def("rescue_column_max(Tensor logits, float scale) -> Tensor");
  // CriticalKVPress's ||v W_o^h||_1 per token, averaged over each KV head's query heads (kernels).
  m.def("output_projected_l1_norms(Tensor values, Tensor o_proj, int num_heads) -> Tensor");
  // MergingPress's nearest kept key: each row's largest dot product with a candidate and its index (kernels).
  m.def("max_similarity(Tensor rows, Tensor candidates) -> (Tensor, Tensor)");
  m.def("snapkv_scores(Tensor window_attn, int num_kv_heads, int kernel_size) -> Tensor", &ops::snapkv_scores);
  m.def("snapkv_scores_from_mean(Tensor mean_attn, int num_kv_heads, int kernel_size, int window_size) -> Tensor",
        &ops::snapkv_scores_from_mean);
  m.def("tova_scores(Tensor last_attn, int num_kv_heads) -> Tensor", &ops::tova_scores);
  m.def("observed_attention_scores(Tensor attentions, int num_kv_heads) -> Tensor", &ops::observed_attention_scores);
}

TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("key_norm_scores", &ops::composite::key_norm_scores);
  m.impl("keydiff_scores", &ops::composite::keydiff_scores);
  m.impl("lagkv_partition_scores", &ops::composite::lagkv_partition_scores);
  m.impl("rescue_column_max", &ops::composite::rescue_column_max);
  m.impl("output_projected_l1_norms", &ops::composite::output_projected_l1_norms);
  m.impl("max_similarity", &ops::composite::max_similarity);
}

}  // namespace kvpress
