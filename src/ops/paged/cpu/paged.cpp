// CPU kernels of the paged KV cache: kvpress::paged_attention (causal attention of n new tokens
// over per-head page lists, on the fused attention core of attention_core.h) and
// kvpress::paged_write (rows copied into pool slots).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "cpu/attention_core.h"
#include "paged/paged.h"

namespace kvpress::kernels {
namespace {

// Unit (b * Hkv + h) * n + i is new token i of head (b, h): it sees the head's tokens
// 0 .. lengths[b, h] - n + i, token t at row t % page_size of page page_table[b, h, t / page_size].
template <typename scalar_t>
struct PagedLayout {
  int64_t units, groups, dim;
  float scale;
  int64_t q_heads, n, kv_heads, page_size, max_pages;
  const scalar_t *q_ptr, *key_pool, *value_pool;
  const int64_t* page_table;  // [B * Hkv, max_pages], host
  const int64_t* lengths;     // [B * Hkv], host
  scalar_t* o_ptr;

  int64_t n_visible(int64_t unit) const { return lengths[unit / n] - n + unit % n + 1; }
  const scalar_t* query(int64_t unit, int64_t g) const {
    const int64_t i = unit % n, bh = unit / n, b = bh / kv_heads, h = bh % kv_heads;
    return q_ptr + ((b * q_heads + h * groups + g) * n + i) * dim;
  }
  scalar_t* output(int64_t unit, int64_t g) const { return o_ptr + (query(unit, g) - q_ptr); }
  int64_t row(int64_t unit, int64_t j) const {
    return (page_table[(unit / n) * max_pages + j / page_size] * page_size + j % page_size) * dim;
  }
  const scalar_t* key(int64_t unit, int64_t j) const { return key_pool + row(unit, j); }
  const scalar_t* value(int64_t unit, int64_t j) const { return value_pool + row(unit, j); }
};

at::Tensor paged_attention_cpu(const at::Tensor& queries, const at::Tensor& key_pool, const at::Tensor& value_pool,
                               const at::Tensor& page_table, const at::Tensor& lengths, std::optional<double> scale) {
  const checks::PagedAttentionArgs a =
      checks::paged_attention_args(queries, key_pool, value_pool, page_table, lengths, scale);
  at::Tensor out = at::empty(a.queries.sizes(), a.queries.options());
  if (a.queries.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.queries.scalar_type(), "paged_attention_cpu", [&] {
    PagedLayout<scalar_t> l;
    l.q_heads = a.queries.size(1);
    l.n = a.queries.size(2);
    l.dim = a.queries.size(3);
    l.kv_heads = a.page_table.size(1);
    l.max_pages = a.page_table.size(2);
    l.page_size = a.key_pool.size(1);
    l.groups = l.q_heads / l.kv_heads;
    l.units = a.queries.size(0) * l.kv_heads * l.n;
    l.scale = static_cast<float>(a.scale);
    l.q_ptr = a.queries.const_data_ptr<scalar_t>();
    l.key_pool = a.key_pool.const_data_ptr<scalar_t>();
    l.value_pool = a.value_pool.const_data_ptr<scalar_t>();
    l.page_table = a.host_page_table.const_data_ptr<int64_t>();
    l.lengths = a.host_lengths.const_data_ptr<int64_t>();
    l.o_ptr = out.data_ptr<scalar_t>();
    run_attention<scalar_t>(l);
  });
  return out;
}

void paged_write_cpu(at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& keys_in,
                     const at::Tensor& values_in, const at::Tensor& slots_in) {
  checks::check_paged_write(key_pool, value_pool, keys_in, values_in, slots_in);
  const at::Tensor keys = keys_in.contiguous(), values = values_in.contiguous(), slots = slots_in.contiguous();
  const int64_t rows = keys.size(0);
  const size_t row_bytes = static_cast<size_t>(keys.size(1)) * keys.element_size();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const auto* k = static_cast<const char*>(keys.const_data_ptr());
  const auto* v = static_cast<const char*>(values.const_data_ptr());
  auto* kp = static_cast<char*>(key_pool.data_ptr());
  auto* vp = static_cast<char*>(value_pool.data_ptr());
  at::parallel_for(0, rows, /*grain_size=*/256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      std::memcpy(kp + slot[r] * row_bytes, k + r * row_bytes, row_bytes);
      std::memcpy(vp + slot[r] * row_bytes, v + r * row_bytes, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("paged_write", &paged_write_cpu);
}

}  // namespace kvpress::kernels
