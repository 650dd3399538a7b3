// The rope_heads family's kernel ops (invert_rope, window_attention_mean), private: their argument checks,
// shared by every backend so all raise the same messages, and their ATen composites (the
// CompositeExplicitAutograd fallback and the tests' reference). The dispatch rule: kernel_ops.h.
#pragma once

#include "kernel_ops.h"

namespace kvpress {
namespace checks {

// window_attention / window_attention_mean: queries [B, Hq, w, D] post-RoPE, keys [B, Hkv, S, D],
// 0 < w < S, Hq a multiple of Hkv, same device.
inline void check_window_attention(const char* op, const at::Tensor& queries, const at::Tensor& keys) {
  check_keys(op, keys);
  check_queries(op, queries, keys, "window");
  check_window(op, "window", queries.size(2), keys.size(2));
}

// apply_rope / invert_rope: x [B, H, n, D] floating with D even, cos/sin [n, D] on x's device.
inline void check_rope(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rank(op, "x", x, 4, "[batch, heads, seq_len, head_dim]");
  check_float(op, "x", x);
  const int64_t n = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0, op, ": head_dim must be even for RoPE, got ", d);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"cos", cos}, {"sin", sin}}) {
    check_defined(op, name, t);
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == d, op, ": ", name, " must be [", n, ", ", d,
                "] ([seq_len, head_dim]), got ", shape_str(t));
    check_same_device(op, name, t, "x", x);
  }
}

}  // namespace checks

namespace ops::composite {

at::Tensor invert_rope(const at::Tensor& x,                  // [B, H, n, D]
                       const at::Tensor& cos,                // [n, D]
                       const at::Tensor& sin);               // [n, D] -> [B, H, n, D]
at::Tensor window_attention_mean(const at::Tensor& queries,  // [B, Hq, w, D]
                                 const at::Tensor& keys);    // [B, Hkv, S, D] -> [B, Hq, S - w] float32

}  // namespace ops::composite
}  // namespace kvpress
