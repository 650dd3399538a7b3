// Shared pieces of the score ops that have dedicated CPU and CUDA kernels (private): argument
// checks, so both backends raise the same messages, and small helpers both use.
#pragma once

#include <ATen/ATen.h>

#include "checks.h"

namespace kvpress::checks {

// window_attention / window_attention_mean: queries [B, Hq, w, D] post-RoPE, keys [B, Hkv, S, D],
// 0 < w < S, Hq a multiple of Hkv, same device.
inline void check_window_attention(const char* op, const at::Tensor& queries, const at::Tensor& keys) {
  check_keys(op, keys);
  check_rank(op, "queries", queries, 4, "[batch, num_heads, window, head_dim]");
  check_float(op, "queries", queries);
  check_same_device(op, "queries", queries, "keys", keys);
  TORCH_CHECK(queries.size(0) == keys.size(0) && queries.size(3) == keys.size(3), op, ": queries must be [",
              keys.size(0), ", num_heads, window, ", keys.size(3), "] to match keys, got ", shape_str(queries));
  check_gqa(op, queries.size(1), keys.size(1));
  check_window(op, "window", queries.size(2), keys.size(2));
}

// lagkv_scores: K/V, n_sink >= 0, lag_size > 0.
inline void check_lagkv(const char* op, const at::Tensor& keys, const at::Tensor& values, int64_t n_sink,
                        int64_t lag_size) {
  check_kv(op, keys, values);
  check_non_negative(op, "n_sink", n_sink);
  check_positive(op, "lag_size", lag_size);
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

}  // namespace kvpress::checks

namespace kvpress::ops {

// The ATen (composite) versions of the kernel ops, registered as their CompositeExplicitAutograd
// fallback (devices without a kernel, CUDA builds without CUDA kernels) and the reference the CPU
// kernels are tested against.
at::Tensor window_attention_mean_aten(const at::Tensor& queries,  // [B, Hq, w, D]
                                      const at::Tensor& keys);    // [B, Hkv, S, D] -> [B, Hq, S - w]
at::Tensor lagkv_partition_scores_aten(const at::Tensor& keys,    // [B, Hkv, S, D]
                                       const at::Tensor& values,  // [B, Hkv, S, D]
                                       int64_t n_sink, int64_t lag_size, bool cross_scoring);  // -> [B, Hkv, S]

}  // namespace kvpress::ops
