// The paged family's kernel ops (paged_attention, paged_write), private: their argument checks,
// shared by every backend so all raise the same messages, and their ATen composites (the
// CompositeExplicitAutograd fallback and the tests' reference). The dispatch rule: kernel_ops.h.
#pragma once

#include "kernel_ops.h"

namespace kvpress {
namespace checks {

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

}  // namespace checks

namespace ops::composite {

at::Tensor paged_attention(const at::Tensor& queries,     // [B, Hq, n, D]
                           const at::Tensor& key_pool,    // [num_pages, page_size, D]
                           const at::Tensor& value_pool,  // [num_pages, page_size, D]
                           const at::Tensor& page_table,  // [B, Hkv, max_pages] int64
                           const at::Tensor& lengths,     // [B, Hkv] int64
                           std::optional<double> scale);  // -> [B, Hq, n, D]
void paged_write(at::Tensor& key_pool,                    // [num_pages, page_size, D], written
                 at::Tensor& value_pool,                  // [num_pages, page_size, D], written
                 const at::Tensor& keys,                  // [N, D]
                 const at::Tensor& values,                // [N, D]
                 const at::Tensor& slots);                // [N] int64

}  // namespace ops::composite
}  // namespace kvpress
