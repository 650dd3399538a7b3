// The scores family's kernel ops (key_norm_scores, keydiff_scores, lagkv_partition_scores,
// rescue_column_max, output_projected_l1_norms, max_similarity), private: their argument
// checks, shared by every backend so all raise the same messages, and their ATen composites (the
// CompositeExplicitAutograd fallback and the tests' reference). The dispatch rule: kernel_ops.h.
#pragma once

#include "kernel_ops.h"

namespace kvpress {
namespace checks {

// lagkv_partition_scores: K/V, n_sink >= 0, lag_size > 0, S >= n_sink + 2 lag_size.
inline void check_lagkv_partitions(const char* op, const at::Tensor& keys, const at::Tensor& values, int64_t n_sink,
                                   int64_t lag_size) {
  check_kv(op, keys, values);
  check_non_negative(op, "n_sink", n_sink);
  check_positive(op, "lag_size", lag_size);
  TORCH_CHECK(keys.size(2) >= n_sink + 2 * lag_size, op, ": seq_len must be >= n_sink + 2 * lag_size (",
              n_sink + 2 * lag_size, "), got ", keys.size(2));
}

// Partition layout of LagKV: P partitions of lag_size tokens after the sinks; partitions 0..P-2
// are scored (each against the next), the sinks and the last partition plus the remainder
// (tail_len tokens) score 1.
struct LagLayout {
  int64_t n_parts, end, tail_len;
};
inline LagLayout lag_layout(int64_t seq, int64_t n_sink, int64_t lag_size) {
  const int64_t n_parts = (seq - n_sink) / lag_size;
  const int64_t end = n_sink + n_parts * lag_size;
  return {n_parts, end, lag_size + seq - end};
}

// rescue_column_max: logits a non-empty float32 [n, R] matrix, scale > 0.
inline void check_rescue_logits(const char* op, const at::Tensor& logits, double scale) {
  check_defined(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) > 0 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat, op,
              ": logits must be a non-empty float32 [rows, keys] matrix, got ", logits.scalar_type(), " ",
              shape_str(logits));
  TORCH_CHECK(scale > 0.0, op, ": scale must be > 0, got ", scale);
}

}  // namespace checks

namespace ops::composite {

at::Tensor key_norm_scores(const at::Tensor& keys);          // [B, Hkv, S, D] -> [B, Hkv, S] float32
at::Tensor keydiff_scores(const at::Tensor& keys);           // [B, Hkv, S, D] -> [B, Hkv, S] float32
at::Tensor lagkv_partition_scores(const at::Tensor& keys,    // [B, Hkv, S, D]
                                  const at::Tensor& values,  // [B, Hkv, S, D]
                                  int64_t n_sink, int64_t lag_size, bool cross_scoring);  // -> [B, Hkv, S] float32

at::Tensor rescue_column_max(const at::Tensor& logits,  // [n, R] float32
                             double scale);             // -> [R] float32

at::Tensor output_projected_l1_norms(const at::Tensor& values,  // [B, Hkv, S, D]
                                     const at::Tensor& o_proj,  // [hidden, num_heads * D]
                                     int64_t num_heads);        // -> [B, Hkv, S] float32

std::tuple<at::Tensor, at::Tensor> max_similarity(const at::Tensor& rows,         // [B, H, n, D] float32
                                                  const at::Tensor& candidates);  // [B, H, m, D] float32

}  // namespace ops::composite
}  // namespace kvpress
