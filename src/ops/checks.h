// Shared validators (private). Every public op validates its arguments here, on every backend,
// so messages look the same everywhere: "<op>: <argument> must be <expected>, got <actual>".
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

namespace kvpress::checks {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// A 0/1 switch from the environment: unset, "" or "0" is false, "1" true; anything else is refused
// rather than guessed ("<who>: <variable> must be 0 or 1, got ...").
inline bool env_flag(const char* variable, const char* who) {
  const char* value = std::getenv(variable);
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "0") == 0) return false;
  TORCH_CHECK(std::strcmp(value, "1") == 0, who, ": ", variable, " must be 0 or 1, got \"", value, "\"");
  return true;
}

inline bool is_supported_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// `t` is defined (present).
inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is required but was not given");
}

// Rank `dims`, `layout` spells the dimension names for the message, e.g. "[batch, kv_heads, seq_len, head_dim]".
inline void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t dims, const char* layout) {
  check_defined(op, name, t);
  TORCH_CHECK(t.dim() == dims, op, ": ", name, " must be ", layout, ", got ", shape_str(t));
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": ", name, " must be float32, float16 or bfloat16, got ",
              t.scalar_type());
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the same device as ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

inline void check_non_empty(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.numel() > 0, op, ": ", name, " must be non-empty, got ", shape_str(t));
}

// keys and values: [B, Hkv, S, D], same shape, supported float dtype, same device, non-empty.
inline void check_kv(const char* op, const at::Tensor& keys, const at::Tensor& values) {
  check_rank(op, "keys", keys, 4, "[batch, kv_heads, seq_len, head_dim]");
  check_float(op, "keys", keys);
  check_non_empty(op, "keys", keys);
  check_rank(op, "values", values, 4, "[batch, kv_heads, seq_len, head_dim]");
  check_float(op, "values", values);
  TORCH_CHECK(values.sizes() == keys.sizes(), op, ": values must have the shape of keys ", shape_str(keys), ", got ",
              shape_str(values));
  TORCH_CHECK(values.scalar_type() == keys.scalar_type(), op, ": values must have the dtype of keys (",
              keys.scalar_type(), "), got ", values.scalar_type());
  check_same_device(op, "values", values, "keys", keys);
}

// keep_mask: [B, Hkv, S] bool over the positions of keys [B, Hkv, S, D], on keys' device.
inline void check_keep_mask(const char* op, const at::Tensor& keep_mask, const at::Tensor& keys) {
  check_rank(op, "keep_mask", keep_mask, 3, "[batch, kv_heads, seq_len]");
  TORCH_CHECK(keep_mask.scalar_type() == at::kBool, op, ": keep_mask must be bool, got ", keep_mask.scalar_type());
  TORCH_CHECK(keep_mask.sizes() == keys.sizes().slice(0, 3), op, ": keep_mask must be [", keys.size(0), ", ",
              keys.size(1), ", ", keys.size(2), "], got ", shape_str(keep_mask));
  check_same_device(op, "keep_mask", keep_mask, "keys", keys);
}

inline void check_keys(const char* op, const at::Tensor& keys) {
  check_rank(op, "keys", keys, 4, "[batch, kv_heads, seq_len, head_dim]");
  check_float(op, "keys", keys);
  check_non_empty(op, "keys", keys);
}

inline void check_ratio(const char* op, double compression_ratio) {
  TORCH_CHECK(std::isfinite(compression_ratio) && compression_ratio >= 0.0 && compression_ratio < 1.0, op,
              ": compression_ratio must be in [0, 1), got ", compression_ratio);
}

// A fraction such as alpha_safeguard or first_stage_ratio: finite and in [0, 1].
inline void check_fraction(const char* op, const char* name, double v) {
  TORCH_CHECK(std::isfinite(v) && v >= 0.0 && v <= 1.0, op, ": ", name, " must be in [0, 1], got ", v);
}

inline void check_finite(const char* op, const char* name, double v) {
  TORCH_CHECK(std::isfinite(v), op, ": ", name, " must be finite, got ", v);
}

inline void check_positive(const char* op, const char* name, int64_t v) {
  TORCH_CHECK(v > 0, op, ": ", name, " must be > 0, got ", v);
}

inline void check_non_negative(const char* op, const char* name, int64_t v) {
  TORCH_CHECK(v >= 0, op, ": ", name, " must be >= 0, got ", v);
}

// A window of `window` trailing positions must leave at least one position before it.
inline void check_window(const char* op, const char* name, int64_t window, int64_t seq_len) {
  check_positive(op, name, window);
  TORCH_CHECK(window < seq_len, op, ": ", name, " must be < seq_len (", seq_len, "), got ", window);
}

inline void check_gqa(const char* op, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0, op,
              ": num_heads must be a positive multiple of num_kv_heads (", num_kv_heads, "), got ", num_heads);
}

// queries [B, Hq, <rows>, D] against keys [B, Hkv, S, D]: floating, on the keys' device, the same B
// and D, Hq a multiple of Hkv. `rows` names the third dimension in messages ("window", "q_len").
inline void check_queries(const char* op, const at::Tensor& queries, const at::Tensor& keys, const char* rows) {
  const std::string layout = std::string("[batch, num_heads, ") + rows + ", head_dim]";
  check_rank(op, "queries", queries, 4, layout.c_str());
  check_float(op, "queries", queries);
  check_same_device(op, "queries", queries, "keys", keys);
  TORCH_CHECK(queries.size(0) == keys.size(0) && queries.size(3) == keys.size(3), op, ": queries must be [",
              keys.size(0), ", num_heads, ", rows, ", ", keys.size(3), "] to match keys, got ", shape_str(queries));
  check_gqa(op, queries.size(1), keys.size(1));
}

// max_similarity: rows [B, H, n, D] and candidates [B, H, m >= 1, D], float32, on one device.
inline void check_similarity_rows(const char* op, const at::Tensor& rows, const at::Tensor& candidates) {
  check_rank(op, "rows", rows, 4, "[batch, heads, rows, head_dim]");
  check_rank(op, "candidates", candidates, 4, "[batch, heads, candidates, head_dim]");
  TORCH_CHECK(rows.scalar_type() == at::kFloat && candidates.scalar_type() == at::kFloat, op,
              ": rows and candidates must be float32, got ", rows.scalar_type(), " and ", candidates.scalar_type());
  TORCH_CHECK(candidates.size(0) == rows.size(0) && candidates.size(1) == rows.size(1) &&
                  candidates.size(3) == rows.size(3) && candidates.size(2) > 0,
              op, ": candidates must be [", rows.size(0), ", ", rows.size(1), ", m >= 1, ", rows.size(3),
              "] (the rows' batch, heads and head_dim), got ", shape_str(candidates));
  check_same_device(op, "candidates", candidates, "rows", rows);
}

// output_projected_l1_norms and CriticalKVPress: values a floating [B, Hkv, S, D] tensor, o_proj a floating
// [hidden, num_heads * D] matrix on the same device, num_heads a positive multiple of Hkv.
inline void check_output_projection(const char* op, const at::Tensor& values, const at::Tensor& o_proj,
                                    int64_t num_heads) {
  check_defined(op, "values", values);
  check_defined(op, "o_proj", o_proj);
  check_rank(op, "values", values, 4, "[batch, kv_heads, seq, head_dim]");
  check_float(op, "values", values);
  check_rank(op, "o_proj", o_proj, 2, "[hidden, num_heads * head_dim]");
  check_float(op, "o_proj", o_proj);
  check_same_device(op, "o_proj", o_proj, "values", values);
  check_gqa(op, num_heads, values.size(1));
  TORCH_CHECK(o_proj.size(0) > 0 && o_proj.size(1) == num_heads * values.size(3), op, ": o_proj must be [hidden, ",
              num_heads * values.size(3), "] (num_heads * head_dim), got ", shape_str(o_proj));
}

// NaN or Inf scores would make top-k selection meaningless; refuse them.
void check_finite_scores(const char* op, const at::Tensor& scores);

}  // namespace kvpress::checks
