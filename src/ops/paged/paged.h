// The paged family's kernel ops (paged_attention, paged_write), private: their argument checks,
// shared by every backend so all raise the same messages, and their ATen composites (the
// CompositeExplicitAutograd fallback and the tests' reference). The dispatch rule: kernel_ops.h.
#pragma once

#include "kernel_ops.h"
#include "kvpress/kv_format.h"
#include "paged/kv_codec.h"

namespace kvpress {
namespace checks {

// The paged ops' index tensors (page tables, lengths, slots): whether the host reads their contents
// to check them. kRead: copied to the host (free on the CPU, a synchronisation on CUDA) and every
// value checked, so the kernel may trust them. kLeaveOnDevice: only their shapes, dtypes and devices
// are checked; the CUDA kernels check each index they use (ops::set_device_argument_checks).
enum class IndexContents { kRead, kLeaveOnDevice };

// The host check of the paged attention ops' index tensors: every head's length in [n, max_length]
// (`bound` names max_length in the message) and the first pages_of(length) entries of its page-table
// row in [0, num_pages). Returns the CPU copies {page_table, lengths}.
template <typename PagesOf>
std::pair<at::Tensor, at::Tensor> read_page_indices(const char* op, const at::Tensor& page_table,
                                                    const at::Tensor& lengths, int64_t n, int64_t max_length,
                                                    const char* bound, int64_t num_pages, PagesOf pages_of) {
  const at::Tensor host_lengths = lengths.to(at::kCPU).contiguous();
  const at::Tensor host_pages = page_table.to(at::kCPU).contiguous();
  const int64_t heads = page_table.size(0) * page_table.size(1), max_pages = page_table.size(2);
  const int64_t* len = host_lengths.const_data_ptr<int64_t>();
  const int64_t* pages = host_pages.const_data_ptr<int64_t>();
  for (int64_t bh = 0; bh < heads; ++bh) {
    TORCH_CHECK(len[bh] >= n && len[bh] <= max_length, op, ": lengths must be in [n (", n, "), ", bound, " (",
                max_length, ")], the queries being those of the last n tokens, got ", len[bh], " for head ", bh);
    for (int64_t p = 0; p < pages_of(len[bh]); ++p) {
      const int64_t page = pages[bh * max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, op, ": page_table must hold pages in [0, ", num_pages,
                  ") where used, got ", page, " at head ", bh, ", slot ", p);
    }
  }
  return {host_pages, host_lengths};
}

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
  std::tie(args.host_page_table, args.host_lengths) = read_page_indices(
      op, page_table, lengths, n, kernels::table_capacity(false, max_pages, page_size), "max_pages * page_size",
      num_pages, [page_size](int64_t length) { return kernels::table_pages(false, length, page_size); });
  return args;
}

// A quantized format as the kernels take it (kv_codec.h).
inline kernels::PageCodec page_codec(KVFormat format) {
  static_assert(static_cast<int>(kernels::PageCodec::kInt8) == static_cast<int>(KVFormat::kInt8) &&
                static_cast<int>(kernels::PageCodec::kFp8) == static_cast<int>(KVFormat::kFp8) &&
                static_cast<int>(kernels::PageCodec::kInt4) == static_cast<int>(KVFormat::kInt4));
  TORCH_CHECK(format != KVFormat::kFull, "page_codec: the format must be int8, fp8 or int4, got full");
  return static_cast<kernels::PageCodec>(format);
}

// paged_attention_quantized's arguments (see kvpress/ops.h), checked and laid out as the kernels
// read them; with IndexContents::kRead the page table, lengths and residual slots are read on the
// host and checked (every used page in the pools, every slot in the residual rows).
struct QuantizedPagedAttentionArgs {
  at::Tensor queries, key_codes, key_scales, value_codes, value_scales;  // contiguous
  KVFormat format;
  at::Tensor page_table, lengths, residual_keys, residual_values, residual_slots;  // contiguous
  at::Tensor host_page_table, host_lengths, host_residual_slots;                   // CPU copies (kRead only)
  double scale;

  // The pools as the kernels read them (T: the queries' element type), with `slots` (residual_slots
  // or its host copy) where the kernel reads them.
  template <typename T>
  kernels::QuantizedPagePools<T> pools(const at::Tensor& slots) const {
    const auto scale_bytes = [&](KVRole role) {
      return kv_page_layout(format, role, key_codes.size(1), queries.size(3), queries.scalar_type())
          .scale_bytes_per_page();
    };
    kernels::QuantizedPagePools<T> p{};
    p.codec = page_codec(format);
    p.page_size = key_codes.size(1);
    p.dim = queries.size(3);
    p.key_codes = key_codes.const_data_ptr<uint8_t>();
    p.value_codes = value_codes.const_data_ptr<uint8_t>();
    p.key_scales = key_scales.const_data_ptr();
    p.value_scales = value_scales.const_data_ptr();
    p.code_bytes = key_codes.size(2);
    p.key_scale_bytes = scale_bytes(KVRole::kKeys);
    p.value_scale_bytes = scale_bytes(KVRole::kValues);
    p.residual_keys = reinterpret_cast<const T*>(residual_keys.const_data_ptr());
    p.residual_values = reinterpret_cast<const T*>(residual_values.const_data_ptr());
    p.residual_slots = slots.const_data_ptr<int64_t>();
    p.residual_rows = residual_keys.size(0);
    return p;
  }
};
inline QuantizedPagedAttentionArgs quantized_paged_attention_args(
    const at::Tensor& queries, const at::Tensor& key_codes, const at::Tensor& key_scales, const at::Tensor& value_codes,
    const at::Tensor& value_scales, KVFormat format, const at::Tensor& page_table, const at::Tensor& lengths,
    const at::Tensor& residual_keys, const at::Tensor& residual_values, const at::Tensor& residual_slots,
    std::optional<double> scale, IndexContents contents = IndexContents::kRead) {
  constexpr const char* op = "paged_attention_quantized";
  check_rank(op, "queries", queries, 4, "[batch, q_heads, n, head_dim]");
  check_float(op, "queries", queries);
  TORCH_CHECK(format != KVFormat::kFull, op,
              ": the format must be int8, fp8 or int4 (paged_attention reads full pages)");
  const int64_t batch = queries.size(0), q_heads = queries.size(1), n = queries.size(2), dim = queries.size(3);
  check_rank(op, "key_codes", key_codes, 3, "[num_pages, page_size, code_bytes]");
  check_rank(op, "page_table", page_table, 3, "[batch, kv_heads, max_pages]");
  check_rank(op, "lengths", lengths, 2, "[batch, kv_heads]");
  check_rank(op, "residual_keys", residual_keys, 4, "[residual_rows, kv_heads, page_size, head_dim]");
  check_rank(op, "residual_slots", residual_slots, 1, "[batch]");
  const int64_t num_pages = key_codes.size(0), page_size = key_codes.size(1);
  const int64_t kv_heads = page_table.size(1), max_pages = page_table.size(2);
  for (const auto& [keys, codes, scales] :
       {std::tuple<bool, const at::Tensor*, const at::Tensor*>{true, &key_codes, &key_scales},
        {false, &value_codes, &value_scales}}) {
    const KVPageLayout layout =
        kv_page_layout(format, keys ? KVRole::kKeys : KVRole::kValues, page_size, dim, queries.scalar_type(), op);
    std::vector<int64_t> scale_shape{num_pages};
    scale_shape.insert(scale_shape.end(), layout.scale_shape.begin(), layout.scale_shape.end());
    const char* role = keys ? "key" : "value";
    TORCH_CHECK(codes->scalar_type() == at::kByte &&
                    codes->sizes() == at::IntArrayRef({num_pages, page_size, layout.code_bytes}),
                op, ": ", role, "_codes must be uint8 [", num_pages, ", ", page_size, ", ", layout.code_bytes, "] (",
                kv_format_name(format), ", head_dim ", dim, "), got ", codes->scalar_type(), " ", shape_str(*codes));
    TORCH_CHECK(scales->scalar_type() == layout.scale_dtype && scales->sizes() == at::IntArrayRef(scale_shape), op,
                ": ", role, "_scales must be ", layout.scale_dtype, " ", at::IntArrayRef(scale_shape), ", got ",
                scales->scalar_type(), " ", shape_str(*scales));
    check_same_device(op, keys ? "key_codes" : "value_codes", *codes, "queries", queries);
    check_same_device(op, keys ? "key_scales" : "value_scales", *scales, "queries", queries);
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"page_table", &page_table},
                                {"lengths", &lengths},
                                {"residual_slots", &residual_slots}}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, op, ": ", name, " must be int64, got ", t->scalar_type());
    check_same_device(op, name, *t, "queries", queries);
  }
  TORCH_CHECK(page_table.size(0) == batch, op, ": page_table must be [", batch, ", kv_heads, max_pages], got ",
              shape_str(page_table));
  check_gqa(op, q_heads, kv_heads);
  TORCH_CHECK(lengths.size(0) == batch && lengths.size(1) == kv_heads, op, ": lengths must be [", batch, ", ", kv_heads,
              "], got ", shape_str(lengths));
  const int64_t rows = residual_keys.size(0);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"residual_keys", &residual_keys},
                                {"residual_values", &residual_values}}) {
    TORCH_CHECK(
        t->scalar_type() == queries.scalar_type() && t->sizes() == at::IntArrayRef({rows, kv_heads, page_size, dim}),
        op, ": ", name, " must be ", queries.scalar_type(), " [", rows, ", ", kv_heads, ", ", page_size, ", ", dim,
        "] (the queries' dtype; kv_heads, page_size and head_dim of the pages), got ", t->scalar_type(), " ",
        shape_str(*t));
    check_same_device(op, name, *t, "queries", queries);
  }
  TORCH_CHECK(residual_slots.size(0) == batch, op, ": residual_slots must be [", batch, "], got ",
              shape_str(residual_slots));
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(dim));
  TORCH_CHECK(std::isfinite(s) && s > 0.0, op, ": scale must be a finite positive number, got ", s);
  QuantizedPagedAttentionArgs args{queries.contiguous(),
                                   key_codes.contiguous(),
                                   key_scales.contiguous(),
                                   value_codes.contiguous(),
                                   value_scales.contiguous(),
                                   format,
                                   page_table.contiguous(),
                                   lengths.contiguous(),
                                   residual_keys.contiguous(),
                                   residual_values.contiguous(),
                                   residual_slots.contiguous(),
                                   {},
                                   {},
                                   {},
                                   s};
  if (contents == IndexContents::kLeaveOnDevice) return args;
  // A head's full pages are in the table; the rest of its tokens (fewer than a page) are residual rows.
  std::tie(args.host_page_table, args.host_lengths) =
      read_page_indices(op, page_table, lengths, n, kernels::table_capacity(true, max_pages, page_size),
                        "(max_pages + 1) * page_size - 1", num_pages,
                        [page_size](int64_t length) { return kernels::table_pages(true, length, page_size); });
  args.host_residual_slots = residual_slots.to(at::kCPU).contiguous();
  const int64_t* slot = args.host_residual_slots.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < rows, op, ": residual_slots must be in [0, ", rows,
                ") (residual_keys' rows), got ", slot[b], " for batch row ", b);
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
// Every quantized page dequantized (ops::kv_dequantize) into a float32 pool, each head's residual rows
// as one more page of it, then paged_attention over float32 queries: the reference of the kernels.
at::Tensor paged_attention_quantized(const at::Tensor& queries,       // [B, Hq, n, D]
                                     const at::Tensor& key_codes,     // [num_pages, page_size, code_bytes] uint8
                                     const at::Tensor& key_scales,    // [num_pages, ...] (kv_page_layout)
                                     const at::Tensor& value_codes,   // [num_pages, page_size, code_bytes] uint8
                                     const at::Tensor& value_scales,  // [num_pages, ...]
                                     KVFormat format,
                                     const at::Tensor& page_table,       // [B, Hkv, max_pages] int64
                                     const at::Tensor& lengths,          // [B, Hkv] int64
                                     const at::Tensor& residual_keys,    // [R, Hkv, page_size, D]
                                     const at::Tensor& residual_values,  // [R, Hkv, page_size, D]
                                     const at::Tensor& residual_slots,   // [B] int64
                                     std::optional<double> scale);       // -> [B, Hq, n, D]
void paged_write(at::Tensor& key_pool,                                   // [num_pages, page_size, D], written
                 at::Tensor& value_pool,                                 // [num_pages, page_size, D], written
                 const at::Tensor& keys,                                 // [N, D]
                 const at::Tensor& values,                               // [N, D]
                 const at::Tensor& slots);                               // [N] int64

}  // namespace ops::composite
}  // namespace kvpress
