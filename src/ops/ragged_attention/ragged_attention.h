// The ragged_attention family's kernel ops (ragged_attention), private: their argument checks,
// shared by every backend so all raise the same messages, and their ATen composites (the
// CompositeExplicitAutograd fallback and the tests' reference). The dispatch rule: kernel_ops.h.
#pragma once

#include "kernel_ops.h"

namespace kvpress {
namespace checks {

// ragged_attention's raw arguments (see kvpress/ops.h); returns the scale to use. Checks the
// offsets' contents too (one small host copy), so a kernel never reads outside the packed rows;
// `longest_packed`, when given, receives the most packed rows a head holds.
inline double check_ragged_attention(const at::Tensor& queries, const at::Tensor& packed_keys,
                                     const at::Tensor& packed_values, const at::Tensor& offsets,
                                     const at::Tensor& tail_keys, const at::Tensor& tail_values,
                                     std::optional<double> scale, int64_t* longest_packed = nullptr) {
  constexpr const char* op = "ragged_attention";
  check_rank(op, "queries", queries, 4, "[batch, q_heads, n, head_dim]");
  check_float(op, "queries", queries);
  check_rank(op, "packed_keys", packed_keys, 2, "[packed_tokens, head_dim]");
  check_rank(op, "packed_values", packed_values, 2, "[packed_tokens, head_dim]");
  check_rank(op, "offsets", offsets, 1, "[batch * kv_heads + 1]");
  check_rank(op, "tail_keys", tail_keys, 4, "[batch, kv_heads, m, head_dim]");
  check_rank(op, "tail_values", tail_values, 4, "[batch, kv_heads, m, head_dim]");
  const at::ScalarType dtype = queries.scalar_type();
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"packed_keys", &packed_keys},
                                {"packed_values", &packed_values},
                                {"tail_keys", &tail_keys},
                                {"tail_values", &tail_values}}) {
    TORCH_CHECK(t->scalar_type() == dtype, op, ": ", name, " must have the dtype of queries (", dtype, "), got ",
                t->scalar_type());
    check_same_device(op, name, *t, "queries", queries);
  }
  TORCH_CHECK(offsets.scalar_type() == at::kLong, op, ": offsets must be int64, got ", offsets.scalar_type());
  check_same_device(op, "offsets", offsets, "queries", queries);
  const int64_t batch = queries.size(0), q_heads = queries.size(1), n = queries.size(2), dim = queries.size(3);
  TORCH_CHECK(dim > 0, op, ": head_dim must be > 0, got queries ", shape_str(queries));
  TORCH_CHECK(tail_keys.size(0) == batch && tail_keys.size(3) == dim, op, ": tail_keys must be [", batch,
              ", kv_heads, m, ", dim, "] like queries, got ", shape_str(tail_keys));
  TORCH_CHECK(tail_values.sizes() == tail_keys.sizes(), op, ": tail_values must have the shape of tail_keys ",
              shape_str(tail_keys), ", got ", shape_str(tail_values));
  const int64_t kv_heads = tail_keys.size(1), m = tail_keys.size(2);
  check_gqa(op, q_heads, kv_heads);
  TORCH_CHECK(n <= m, op, ": the queries must be those of the last n tail tokens, so n must be <= the tail length (", m,
              "), got ", n);
  TORCH_CHECK(packed_keys.size(1) == dim, op, ": packed_keys must be [packed_tokens, ", dim, "], got ",
              shape_str(packed_keys));
  TORCH_CHECK(packed_values.sizes() == packed_keys.sizes(), op, ": packed_values must have the shape of packed_keys ",
              shape_str(packed_keys), ", got ", shape_str(packed_values));
  TORCH_CHECK(offsets.size(0) == batch * kv_heads + 1, op, ": offsets must be [batch * kv_heads + 1] = [",
              batch * kv_heads + 1, "], got ", shape_str(offsets));
  const at::Tensor host = offsets.to(at::kCPU).contiguous();
  const int64_t* o = host.const_data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0, op, ": offsets[0] must be 0, got ", o[0]);
  int64_t longest = 0;
  for (int64_t i = 0; i < batch * kv_heads; ++i) {
    TORCH_CHECK(o[i + 1] >= o[i], op, ": offsets must be non-decreasing, got offsets[", i, "] = ", o[i], " > offsets[",
                i + 1, "] = ", o[i + 1]);
    longest = std::max(longest, o[i + 1] - o[i]);
  }
  if (longest_packed != nullptr) *longest_packed = longest;
  TORCH_CHECK(o[batch * kv_heads] == packed_keys.size(0), op, ": offsets[", batch * kv_heads,
              "] must equal the packed token count ", packed_keys.size(0), ", got ", o[batch * kv_heads]);
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(dim));
  TORCH_CHECK(std::isfinite(s) && s > 0.0, op, ": scale must be a finite positive number, got ", s);
  return s;
}

// ragged_attention's arguments, checked (check_ragged_attention) and laid out as the kernels read
// them: queries, packed rows and offsets contiguous; the tail may stay a strided view of a larger
// buffer as long as its rows are contiguous.
struct RaggedAttentionArgs {
  at::Tensor queries, packed_keys, packed_values, offsets, tail_keys, tail_values;
  double scale;
  int64_t longest_packed;  // the most packed rows a head holds
};
inline RaggedAttentionArgs ragged_attention_args(const at::Tensor& queries, const at::Tensor& packed_keys,
                                                 const at::Tensor& packed_values, const at::Tensor& offsets,
                                                 const at::Tensor& tail_keys, const at::Tensor& tail_values,
                                                 std::optional<double> scale) {
  int64_t longest_packed = 0;
  const double s = check_ragged_attention(queries, packed_keys, packed_values, offsets, tail_keys, tail_values, scale,
                                          &longest_packed);
  const auto rows_contiguous = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  return {queries.contiguous(),
          packed_keys.contiguous(),
          packed_values.contiguous(),
          offsets.contiguous(),
          rows_contiguous(tail_keys),
          rows_contiguous(tail_values),
          s,
          longest_packed};
}

}  // namespace checks

namespace ops::composite {

at::Tensor ragged_attention(const at::Tensor& queries,        // [B, Hq, n, D]
                            const at::Tensor& packed_keys,    // [T, D]
                            const at::Tensor& packed_values,  // [T, D]
                            const at::Tensor& offsets,        // [B * Hkv + 1] int64
                            const at::Tensor& tail_keys,      // [B, Hkv, m, D]
                            const at::Tensor& tail_values,    // [B, Hkv, m, D]
                            std::optional<double> scale);     // -> [B, Hq, n, D]

}  // namespace ops::composite
}  // namespace kvpress
