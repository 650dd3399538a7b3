// The compactor family's kernel ops (sketch_prerope_keys, noncausal_column_sums, cholesky_leverage), private: their
// argument checks, shared by every backend so all raise the same messages, and their ATen composites (the
// CompositeExplicitAutograd fallback and the tests' reference). The dispatch rule: kernel_ops.h.
#pragma once

#include "kernel_ops.h"
#include "rope_heads/rope_heads.h"  // check_rope: sketch_prerope_keys undoes RoPE

namespace kvpress {
namespace checks {

// A sketch [D, k] (one for every head) or [B, Hkv, D, k], floating, non-empty, on the device of the
// keys (named `keys_name` in the messages).
inline void check_sketch(const char* op, const char* keys_name, const at::Tensor& keys, const at::Tensor& sketch) {
  check_keys(op, keys);
  check_defined(op, "sketch", sketch);
  check_float(op, "sketch", sketch);
  check_same_device(op, "sketch", sketch, keys_name, keys);
  const int64_t dim = keys.size(3);
  TORCH_CHECK((sketch.dim() == 2 && sketch.size(0) == dim) || (sketch.dim() == 4 && sketch.size(0) == keys.size(0) &&
                                                               sketch.size(1) == keys.size(1) && sketch.size(2) == dim),
              op, ": sketch must be [", dim, ", k] or [", keys.size(0), ", ", keys.size(1), ", ", dim, ", k], got ",
              shape_str(sketch));
  check_non_empty(op, "sketch", sketch);
}

// Post-RoPE queries of every position: [B, Hq, S, D] matching keys [B, Hkv, S, D].
inline void check_all_queries(const char* op, const at::Tensor& queries, const at::Tensor& keys) {
  check_rank(op, "queries", queries, 4, "[batch, num_heads, seq_len, head_dim]");
  check_float(op, "queries", queries);
  check_same_device(op, "queries", queries, "keys", keys);
  TORCH_CHECK(queries.size(0) == keys.size(0) && queries.size(3) == keys.size(3), op, ": queries must be [",
              keys.size(0), ", num_heads, ", keys.size(2), ", ", keys.size(3), "] to match keys, got ",
              shape_str(queries));
  TORCH_CHECK(queries.size(2) == keys.size(2), op, ": queries must cover every position (q_len == seq_len ",
              keys.size(2), "), got q_len ", queries.size(2));
  check_gqa(op, queries.size(1), keys.size(1));
}

// noncausal_column_sums: keys [B, Hkv, S, D], the post-RoPE queries of every position, chunk_size > 0.
inline void check_noncausal(const char* op, const at::Tensor& queries, const at::Tensor& keys, int64_t chunk_size) {
  check_keys(op, keys);
  check_positive(op, "chunk_size", chunk_size);
  check_all_queries(op, queries, keys);
}

// sketch_prerope_keys: keys [B, Hkv, S, D] with their RoPE tables cos / sin [S, D] and a sketch
// (check_sketch).
inline void check_sketch_prerope_keys(const at::Tensor& keys, const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& sketch) {
  constexpr const char* op = "sketch_prerope_keys";
  check_sketch(op, "keys", keys, sketch);
  check_rope(op, keys, cos, sin);
}

// cholesky_leverage: sketched [B, H, S, k] float32 non-empty, factor [B, H, k, k] float32 on its device.
inline void check_cholesky_leverage(const char* op, const at::Tensor& sketched, const at::Tensor& factor) {
  check_rank(op, "sketched", sketched, 4, "[batch, kv_heads, seq_len, sketch_dimension]");
  check_non_empty(op, "sketched", sketched);
  TORCH_CHECK(sketched.scalar_type() == at::kFloat, op, ": sketched must be float32, got ", sketched.scalar_type());
  check_defined(op, "factor", factor);
  const int64_t k = sketched.size(3);
  TORCH_CHECK(factor.dim() == 4 && factor.size(0) == sketched.size(0) && factor.size(1) == sketched.size(1) &&
                  factor.size(2) == k && factor.size(3) == k,
              op, ": factor must be [", sketched.size(0), ", ", sketched.size(1), ", ", k, ", ", k, "], got ",
              shape_str(factor));
  TORCH_CHECK(factor.scalar_type() == at::kFloat, op, ": factor must be float32, got ", factor.scalar_type());
  check_same_device(op, "factor", factor, "sketched", sketched);
}

}  // namespace checks

namespace ops::composite {

std::tuple<at::Tensor, at::Tensor> sketch_prerope_keys(
    const at::Tensor& keys,                                  // [B, Hkv, S, D] post-RoPE
    const at::Tensor& cos,                                   // [S, D]
    const at::Tensor& sin,                                   // [S, D]
    const at::Tensor& sketch);                               // [B, Hkv, D, k] or [D, k]
                                                             // -> X [B, Hkv, S, k], XᵀX [B, Hkv, k, k]
at::Tensor noncausal_column_sums(const at::Tensor& queries,  // [B, Hq, S, D] post-RoPE
                                 const at::Tensor& keys,     // [B, Hkv, S, D]
                                 int64_t chunk_size);        // -> [B, Hq, S] float32
at::Tensor cholesky_leverage(const at::Tensor& sketched,     // [B, Hkv, S, k] float32
                             const at::Tensor& factor);      // [B, Hkv, k, k] -> [B, Hkv, S] float32

}  // namespace ops::composite

namespace ops {
// L⁻¹ of the lower-triangular Cholesky factors (one small triangular solve per head), the matrix
// cholesky_leverage's composite and kernels apply to every sketched row.
at::Tensor lower_triangular_inverse(const at::Tensor& factor);  // [B, H, k, k] -> [B, H, k, k]
// X rows of one KV head from its centred pre-RoPE keys: x_head[b, 0] = centred[b, 0] Φ, the GEMM in
// the keys' dtype as kvpress's (Φ converted to it), written into float32 X. sketch_prerope_keys'
// composite and its CUDA bridge.
void sketch_centred_into(const at::Tensor& centred,  // [B, 1, S, D]
                         const at::Tensor& sketch,   // [D, k] or [B, 1, D, k]
                         const at::Tensor& x_head);  // [B, 1, S, k] float32, written
}  // namespace ops
}  // namespace kvpress
