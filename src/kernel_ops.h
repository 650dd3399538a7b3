// The ops that have dedicated CPU and CUDA kernels (private): their argument checks, shared by every
// backend so all raise the same messages, and their ATen composites, registered as the
// CompositeExplicitAutograd fallback (devices without a kernel, builds without CUDA kernels) and
// used by the tests as the reference the kernels must match.
//
// The dispatch rule: the public function in kvpress/ops.h calls the dispatcher (dispatcher_op
// below); the dispatcher picks the kernel registered for the tensors' device
// (TORCH_LIBRARY_IMPL(kvpress, CPU | CUDA) in kernels/), else the composite. No code in src/
// branches on the device.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <utility>

#include "checks.h"

namespace kvpress {

// The typed dispatcher handle of kvpress::<name>, looked up once per call site:
//   static const auto op = dispatcher_op<at::Tensor(const at::Tensor&)>("kvpress::key_norm_scores");
//   return op.call(keys);
template <typename Signature>
c10::TypedOperatorHandle<Signature> dispatcher_op(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Signature>();
}

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

// window_attention / window_attention_mean: queries [B, Hq, w, D] post-RoPE, keys [B, Hkv, S, D],
// 0 < w < S, Hq a multiple of Hkv, same device.
inline void check_window_attention(const char* op, const at::Tensor& queries, const at::Tensor& keys) {
  check_keys(op, keys);
  check_queries(op, queries, keys, "window");
  check_window(op, "window", queries.size(2), keys.size(2));
}

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

// The paged ops' index tensors (page tables, lengths, slots): whether the host reads their contents
// to check them. kRead: copied to the host (free on the CPU, a synchronisation on CUDA) and every
// value checked, so the kernel may trust them. kLeaveOnDevice: only their shapes, dtypes and devices
// are checked; the CUDA kernels check each index they use (ops::set_device_argument_checks).
enum class IndexContents { kRead, kLeaveOnDevice };

// paged_attention's arguments (see kvpress/ops.h), checked and laid out as the kernels read them.
// With IndexContents::kRead the page table and lengths are also copied to the host and every page a
// head uses is checked to lie in the pool, so a kernel never reads outside it.
struct PagedAttentionArgs {
  at::Tensor queries, key_pool, value_pool, page_table, lengths;  // contiguous
  at::Tensor host_page_table, host_lengths;                       // CPU copies (kRead only)
  double scale;
};
inline PagedAttentionArgs paged_attention_args(const at::Tensor& queries, const at::Tensor& key_pool,
                                               const at::Tensor& value_pool, const at::Tensor& page_table,
                                               const at::Tensor& lengths, std::optional<double> scale,
                                               IndexContents contents = IndexContents::kRead) {
  constexpr const char* op = "paged_attention";
  check_rank(op, "queries", queries, 4, "[batch, q_heads, n, head_dim]");
  check_float(op, "queries", queries);
  check_rank(op, "key_pool", key_pool, 3, "[num_pages, page_size, head_dim]");
  check_rank(op, "value_pool", value_pool, 3, "[num_pages, page_size, head_dim]");
  check_rank(op, "page_table", page_table, 3, "[batch, kv_heads, max_pages]");
  check_rank(op, "lengths", lengths, 2, "[batch, kv_heads]");
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"key_pool", &key_pool}, {"value_pool", &value_pool}}) {
    TORCH_CHECK(t->scalar_type() == queries.scalar_type(), op, ": ", name, " must have the dtype of queries (",
                queries.scalar_type(), "), got ", t->scalar_type());
    check_same_device(op, name, *t, "queries", queries);
  }
  for (const auto& [name, t] :
       {std::pair<const char*, const at::Tensor*>{"page_table", &page_table}, {"lengths", &lengths}}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, op, ": ", name, " must be int64, got ", t->scalar_type());
    check_same_device(op, name, *t, "queries", queries);
  }
  TORCH_CHECK(value_pool.sizes() == key_pool.sizes(), op, ": value_pool must have the shape of key_pool ",
              shape_str(key_pool), ", got ", shape_str(value_pool));
  const int64_t batch = queries.size(0), q_heads = queries.size(1), n = queries.size(2), dim = queries.size(3);
  const int64_t num_pages = key_pool.size(0), page_size = key_pool.size(1);
  TORCH_CHECK(key_pool.size(2) == dim && dim > 0, op, ": key_pool must be [num_pages, page_size, ", dim,
              "] like queries, got ", shape_str(key_pool));
  TORCH_CHECK(page_table.size(0) == batch, op, ": page_table must be [", batch, ", kv_heads, max_pages], got ",
              shape_str(page_table));
  const int64_t kv_heads = page_table.size(1), max_pages = page_table.size(2);
  check_gqa(op, q_heads, kv_heads);
  TORCH_CHECK(lengths.size(0) == batch && lengths.size(1) == kv_heads, op, ": lengths must be [", batch, ", ", kv_heads,
              "], got ", shape_str(lengths));
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(dim));
  TORCH_CHECK(std::isfinite(s) && s > 0.0, op, ": scale must be a finite positive number, got ", s);
  PagedAttentionArgs args{queries.contiguous(),
                          key_pool.contiguous(),
                          value_pool.contiguous(),
                          page_table.contiguous(),
                          lengths.contiguous(),
                          {},
                          {},
                          s};
  if (contents == IndexContents::kLeaveOnDevice) return args;
  const at::Tensor host_lengths = lengths.to(at::kCPU).contiguous();
  const at::Tensor host_pages = page_table.to(at::kCPU).contiguous();
  const int64_t* len = host_lengths.const_data_ptr<int64_t>();
  const int64_t* pages = host_pages.const_data_ptr<int64_t>();
  for (int64_t bh = 0; bh < batch * kv_heads; ++bh) {
    TORCH_CHECK(len[bh] >= n && len[bh] <= max_pages * page_size, op, ": lengths must be in [n (", n,
                "), max_pages * page_size (", max_pages * page_size,
                ")], the queries being those of the last n "
                "tokens, got ",
                len[bh], " for head ", bh);
    for (int64_t p = 0; p < (len[bh] + page_size - 1) / page_size; ++p) {
      const int64_t page = pages[bh * max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, op, ": page_table must hold pages in [0, ", num_pages,
                  ") where used, got ", page, " at head ", bh, ", slot ", p);
    }
  }
  args.host_page_table = host_pages;
  args.host_lengths = host_lengths;
  return args;
}

// paged_write: pools [num_pages, page_size, D] contiguous, rows [N, D] of their dtype, slots [N]
// int64 (page * page_size + offset) in range, every tensor on the pools' device.
// With IndexContents::kRead, slots are also copied to the host and checked: in range and distinct.
inline void check_paged_write(const at::Tensor& key_pool, const at::Tensor& value_pool, const at::Tensor& keys,
                              const at::Tensor& values, const at::Tensor& slots,
                              IndexContents contents = IndexContents::kRead) {
  constexpr const char* op = "paged_write";
  check_rank(op, "key_pool", key_pool, 3, "[num_pages, page_size, head_dim]");
  check_float(op, "key_pool", key_pool);
  TORCH_CHECK(value_pool.sizes() == key_pool.sizes() && value_pool.scalar_type() == key_pool.scalar_type(), op,
              ": value_pool must be ", key_pool.scalar_type(), " ", shape_str(key_pool), " like key_pool, got ",
              value_pool.scalar_type(), " ", shape_str(value_pool));
  TORCH_CHECK(key_pool.is_contiguous() && value_pool.is_contiguous(), op, ": the pools must be contiguous");
  check_rank(op, "keys", keys, 2, "[n, head_dim]");
  TORCH_CHECK(keys.size(1) == key_pool.size(2) && values.sizes() == keys.sizes(), op, ": keys and values must be [n, ",
              key_pool.size(2), "], got ", shape_str(keys), " and ", shape_str(values));
  TORCH_CHECK(keys.scalar_type() == key_pool.scalar_type() && values.scalar_type() == key_pool.scalar_type(), op,
              ": keys and values must be ", key_pool.scalar_type(), " like the pools, got ", keys.scalar_type(),
              " and ", values.scalar_type());
  check_rank(op, "slots", slots, 1, "[n]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.size(0) == keys.size(0), op, ": slots must be int64 [",
              keys.size(0), "], got ", slots.scalar_type(), " ", shape_str(slots));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"value_pool", &value_pool},
                                {"keys", &keys},
                                {"values", &values},
                                {"slots", &slots}})
    check_same_device(op, name, *t, "key_pool", key_pool);
  if (slots.numel() == 0 || contents == IndexContents::kLeaveOnDevice) return;
  // The slots sorted, on the host (one copy): their range, and no slot twice (two rows for one slot
  // would be written by two threads on the CPU, or blocks on CUDA, in no set order).
  const at::Tensor sorted = std::get<0>(slots.sort()).cpu();
  const int64_t* s = sorted.const_data_ptr<int64_t>();
  const int64_t n = sorted.numel(), capacity = key_pool.size(0) * key_pool.size(1);
  TORCH_CHECK(s[0] >= 0 && s[n - 1] < capacity, op, ": slots must be in [0, num_pages * page_size (", capacity,
              ")), got values in [", s[0], ", ", s[n - 1], "]");
  if (const int64_t* repeat = std::adjacent_find(s, s + n); repeat != s + n)
    TORCH_CHECK(false, op, ": slots must be distinct (each pool slot written once), got slot ", *repeat,
                " more than once");
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

// Reads and clears the record of bad device data of CUDA device `index` (ops::check_device_errors)
// and raises what it names. The CUDA kernels' host part (kernels/cuda/device_errors.cpp) registers
// it when the library is built with them.
using DeviceErrorCheck = void (*)(c10::DeviceIndex index);
void register_cuda_device_error_check(DeviceErrorCheck check);

// ---- ATen composites of the kernel ops (same contracts as kvpress/ops.h) ----------------------
namespace ops::composite {

at::Tensor topk_indices(const at::Tensor& scores,                         // [B, H, S] floating
                        int64_t k);                                       // -> [B, H, k] int64, ascending
std::tuple<at::Tensor, at::Tensor> gather_kv(const at::Tensor& keys,      // [B, Hkv, S, D]
                                             const at::Tensor& values,    // [B, Hkv, S, D]
                                             const at::Tensor& indices);  // [B, Hkv, n] int64
void compact_kv_(const at::Tensor& keys,                                  // [B, Hkv, S, D], written
                 const at::Tensor& values,                                // [B, Hkv, S, D], written
                 const at::Tensor& indices);                              // [B, Hkv, n] int64, ascending
at::Tensor invert_rope(const at::Tensor& x,                               // [B, H, n, D]
                       const at::Tensor& cos,                             // [n, D]
                       const at::Tensor& sin);                            // [n, D] -> [B, H, n, D]
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
at::Tensor key_norm_scores(const at::Tensor& keys);          // [B, Hkv, S, D] -> [B, Hkv, S] float32
at::Tensor keydiff_scores(const at::Tensor& keys);           // [B, Hkv, S, D] -> [B, Hkv, S] float32
at::Tensor window_attention_mean(const at::Tensor& queries,  // [B, Hq, w, D]
                                 const at::Tensor& keys);    // [B, Hkv, S, D] -> [B, Hq, S - w] float32
at::Tensor lagkv_partition_scores(const at::Tensor& keys,    // [B, Hkv, S, D]
                                  const at::Tensor& values,  // [B, Hkv, S, D]
                                  int64_t n_sink, int64_t lag_size, bool cross_scoring);  // -> [B, Hkv, S] float32
at::Tensor ragged_attention(const at::Tensor& queries,                                    // [B, Hq, n, D]
                            const at::Tensor& packed_keys,                                // [T, D]
                            const at::Tensor& packed_values,                              // [T, D]
                            const at::Tensor& offsets,                                    // [B * Hkv + 1] int64
                            const at::Tensor& tail_keys,                                  // [B, Hkv, m, D]
                            const at::Tensor& tail_values,                                // [B, Hkv, m, D]
                            std::optional<double> scale);                                 // -> [B, Hq, n, D]
at::Tensor paged_attention(const at::Tensor& queries,                                     // [B, Hq, n, D]
                           const at::Tensor& key_pool,                                    // [num_pages, page_size, D]
                           const at::Tensor& value_pool,                                  // [num_pages, page_size, D]
                           const at::Tensor& page_table,                                  // [B, Hkv, max_pages] int64
                           const at::Tensor& lengths,                                     // [B, Hkv] int64
                           std::optional<double> scale);                                  // -> [B, Hq, n, D]
void paged_write(at::Tensor& key_pool,      // [num_pages, page_size, D], written
                 at::Tensor& value_pool,    // [num_pages, page_size, D], written
                 const at::Tensor& keys,    // [N, D]
                 const at::Tensor& values,  // [N, D]
                 const at::Tensor& slots);  // [N] int64

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
