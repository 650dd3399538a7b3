// The selection family's kernel ops (topk_indices, gather_kv, compact_kv_), private: their argument checks,
// shared by every backend so all raise the same messages, and their ATen composites (the
// CompositeExplicitAutograd fallback and the tests' reference). The dispatch rule: kernel_ops.h.
#pragma once

#include "kernel_ops.h"

namespace kvpress {
namespace checks {

// topk_indices: scores [B, H, S] floating and non-empty, 1 <= k <= S.
inline void check_topk(const char* op, const at::Tensor& scores, int64_t k) {
  check_rank(op, "scores", scores, 3, "[batch, heads, seq_len]");
  check_non_empty(op, "scores", scores);
  TORCH_CHECK(at::isFloatingType(scores.scalar_type()), op, ": scores must be a floating tensor, got ",
              scores.scalar_type());
  const int64_t seq_len = scores.size(2);
  TORCH_CHECK(k >= 1 && k <= seq_len, op, ": k must be in [1, seq_len (", seq_len, ")], got ", k);
}

// gather_kv: K/V, indices [B, Hkv, n] int64 on their device. The range of the indices is checked by
// the kernels while they copy (raise_bad_indices).
inline void check_gather(const char* op, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices) {
  check_kv(op, keys, values);
  check_rank(op, "indices", indices, 3, "[batch, kv_heads, n_kept]");
  TORCH_CHECK(indices.scalar_type() == at::kLong, op, ": indices must be int64, got ", indices.scalar_type());
  TORCH_CHECK(indices.size(0) == keys.size(0) && indices.size(1) == keys.size(1), op, ": indices must be [",
              keys.size(0), ", ", keys.size(1), ", n_kept], got ", shape_str(indices));
  check_same_device(op, "indices", indices, "keys", keys);
}

// Raises for indices outside [0, seq_len) when there are any (a kernel found one), naming the range.
inline void check_index_range(const char* op, const at::Tensor& indices, int64_t seq_len) {
  if (indices.numel() == 0) return;
  const int64_t lo = indices.min().item<int64_t>();
  const int64_t hi = indices.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < seq_len, op, ": indices must be in [0, seq_len (", seq_len, ")), got values in [", lo,
              ", ", hi, "]");
}

// compact_kv_in_place: gather_kv's arguments, a unit stride along D, and indices strictly ascending
// per head within [0, S) (checked on the indices' device before anything moves).
inline void check_compact(const char* op, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices) {
  check_gather(op, keys, values, indices);
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, op,
              ": keys and values need a unit stride along head_dim, got strides ", keys.strides(), " and ",
              values.strides());
  // Written in place: every element must be its own memory (no expanded views) and K apart from V.
  TORCH_CHECK(at::has_internal_overlap(keys) != at::MemOverlap::Yes &&
                  at::has_internal_overlap(values) != at::MemOverlap::Yes &&
                  at::get_overlap_status(keys, values) != at::MemOverlapStatus::Full &&
                  at::get_overlap_status(keys, values) != at::MemOverlapStatus::Partial,
              op, ": keys and values must be writable tensors that share no memory (no expanded views)");
  TORCH_CHECK(indices.size(2) <= keys.size(2), op, ": indices must keep at most seq_len (", keys.size(2),
              ") positions per head, got ", indices.size(2));
  check_index_range(op, indices, keys.size(2));
  if (indices.size(2) > 1) {
    const at::Tensor steps = indices.narrow(2, 1, indices.size(2) - 1) - indices.narrow(2, 0, indices.size(2) - 1);
    TORCH_CHECK(steps.min().item<int64_t>() > 0, op, ": indices must be strictly ascending per head");
  }
}

}  // namespace checks

namespace ops::composite {

at::Tensor topk_indices(const at::Tensor& scores,                         // [B, H, S] floating
                        int64_t k);                                       // -> [B, H, k] int64, ascending
std::tuple<at::Tensor, at::Tensor> gather_kv(const at::Tensor& keys,      // [B, Hkv, S, D]
                                             const at::Tensor& values,    // [B, Hkv, S, D]
                                             const at::Tensor& indices);  // [B, Hkv, n] int64
void compact_kv_(const at::Tensor& keys,                                  // [B, Hkv, S, D], written
                 const at::Tensor& values,                                // [B, Hkv, S, D], written
                 const at::Tensor& indices);                              // [B, Hkv, n] int64, ascending

}  // namespace ops::composite
}  // namespace kvpress
