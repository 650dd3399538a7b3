// CPU kernels of the paged KV cache: kvpress::paged_attention (causal attention of n new tokens
// over per-head page lists, on the fused attention core of attention_core.h) and
// kvpress::paged_write (rows copied into pool slots).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "cpu/attention_core.h"
#include "cpu/per_isa.h"
#include "paged/kv_codec.h"
#include "paged/paged.h"

namespace kvpress::kernels {
namespace {

// What the paged layouts share. Unit (b * Hkv + h) * n + i is new token i of head (b, h): it sees
// the head's tokens 0 .. lengths[b, h] - n + i.
template <typename scalar_t>
struct PagedUnits {
  int64_t units, groups, dim;
  float scale;
  int64_t q_heads, n, kv_heads, page_size, max_pages;
  const scalar_t* q_ptr;
  const int64_t* page_table;  // [B * Hkv, max_pages], host
  const int64_t* lengths;     // [B * Hkv], host
  scalar_t* o_ptr;

  // queries [B, Hq, n, D] and out (its shape), the host tables [B, Hkv, max_pages] and [B, Hkv].
  void set_units(const at::Tensor& queries, const at::Tensor& host_page_table, const at::Tensor& host_lengths,
                 int64_t pages_of, double attention_scale, at::Tensor& out) {
    q_heads = queries.size(1);
    n = queries.size(2);
    dim = queries.size(3);
    kv_heads = host_page_table.size(1);
    max_pages = host_page_table.size(2);
    page_size = pages_of;
    groups = q_heads / kv_heads;
    units = queries.size(0) * kv_heads * n;
    scale = static_cast<float>(attention_scale);
    q_ptr = queries.const_data_ptr<scalar_t>();
    page_table = host_page_table.const_data_ptr<int64_t>();
    lengths = host_lengths.const_data_ptr<int64_t>();
    o_ptr = out.data_ptr<scalar_t>();
  }
  int64_t n_visible(int64_t unit) const { return lengths[unit / n] - n + unit % n + 1; }
  const scalar_t* query(int64_t unit, int64_t g) const {
    const int64_t i = unit % n, bh = unit / n, b = bh / kv_heads, h = bh % kv_heads;
    return q_ptr + ((b * q_heads + h * groups + g) * n + i) * dim;
  }
  scalar_t* output(int64_t unit, int64_t g) const { return o_ptr + (query(unit, g) - q_ptr); }
  // Token j of the unit's head: its page and its row in the page.
  int64_t page(int64_t unit, int64_t j) const { return page_table[(unit / n) * max_pages + j / page_size]; }
};

// Full pages: token t at row t % page_size of page page_table[b, h, t / page_size] of the pools.
template <typename scalar_t>
struct PagedLayout : PagedUnits<scalar_t>, StoredRows<scalar_t, PagedLayout<scalar_t>> {
  const scalar_t *key_pool, *value_pool;

  int64_t row(int64_t unit, int64_t j) const {
    return (this->page(unit, j) * this->page_size + j % this->page_size) * this->dim;
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
    l.set_units(a.queries, a.host_page_table, a.host_lengths, a.key_pool.size(1), a.scale, out);
    l.key_pool = a.key_pool.const_data_ptr<scalar_t>();
    l.value_pool = a.value_pool.const_data_ptr<scalar_t>();
    run_attention<scalar_t>(l);
  });
  return out;
}

// kv_codec.h's conversions on the host. float16: c10's. fp8 (e4m3fn): exact for all 256 codes in
// branch-free integer arithmetic that gcc vectorises (selects by `?:` kept the loop scalar): the 7
// magnitude bits shifted into float32's exponent and mantissa fields and the exponent rebased
// (bias 7 -> 127); codes of exponent 0 are subnormal, m x 2^-9; 0x7f is NaN (e4m3fn has no
// infinity); then the sign bit. About 20 vector operations per vector of codes, it costs what the
// 256-entry table it replaced did in gathers (docs/PERFORMANCE.md "Quantized pages": about twice
// int8's time). F16C's vcvtph2ps would need a few: an e4m3 byte's fields moved into float16's
// (magnitude << 7, sign << 8) are float16 bits of 2^-8 times its value, subnormals included.
struct HostNumbers {
  static float half(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }
  static float fp8(uint8_t bits) {
    const uint32_t magnitude = bits & 0x7Fu;
    const uint32_t normal = (magnitude << 20) + (120u << 23);
    const uint32_t subnormal = c10::bit_cast<uint32_t>(static_cast<float>(magnitude) * 0x1p-9f);
    const uint32_t is_subnormal = ((magnitude + 120u) >> 7) - 1u;  // all ones for magnitude < 8
    const uint32_t is_nan = 0u - ((magnitude + 1u) >> 7);          // all ones for magnitude 0x7f
    const uint32_t value = (normal & ~is_subnormal) | (subnormal & is_subnormal) | (is_nan & 0x7FC00000u);
    return c10::bit_cast<float>(value | (static_cast<uint32_t>(bits & 0x80u) << 24));
  }
};

// Row r of a quantized page as float32 ([dim] into out): kv_codec.h's formulas in loops compiled
// for AVX-512, for AVX2 + FMA and for the baseline (run_per_isa), written so that gcc vectorises
// them: int8 a conversion and a product, fp8 its bit arithmetic, int4 the codes unpacked a byte
// (two channels) at a time, then scaled (the float16 scales converted lane-wise).
struct DequantizeRow {
  template <PageCodec kCodec>
  KVPRESS_VEC_INLINE static void codes(PageRef page, int64_t r, int64_t dim, float* out) {
    for (int64_t d = 0; d < dim; ++d) out[d] = page_element<HostNumbers, kCodec>(false, page, r, dim, d);
  }
  template <bool kKeys>
  KVPRESS_VEC_INLINE static void int4(PageRef page, int64_t r, int64_t dim, float* out) {
    const uint8_t* q = page.codes + r * (dim / 2);
    for (int64_t i = 0; i < dim / 2; ++i) {
      out[2 * i] = static_cast<float>(int4_even_code(q[i]));
      out[2 * i + 1] = static_cast<float>(int4_odd_code(q[i]));
    }
    const auto* s = static_cast<const uint16_t*>(page.scales);
    for (int64_t d = 0; d < dim; ++d) out[d] = int4_value<HostNumbers>(out[d], kKeys, s, r, dim, d);
  }
  template <class V>
  KVPRESS_VEC_INLINE static void run(PageCodec codec, bool keys, PageRef page, int64_t r, int64_t dim, float* out) {
    switch (codec) {
      case PageCodec::kInt8: return codes<PageCodec::kInt8>(page, r, dim, out);
      case PageCodec::kFp8: return codes<PageCodec::kFp8>(page, r, dim, out);
      case PageCodec::kInt4: return keys ? int4<true>(page, r, dim, out) : int4<false>(page, r, dim, out);
    }
  }
};

// Quantized pages (kv_codec.h): key j of head (b, h) is row j % page_size of page
// page_table[b, h, j / page_size] while j lies in the head's full pages, else row j - full_tokens of
// its residual rows, in the queries' dtype.
template <typename scalar_t>
struct QuantizedPagedLayout : PagedUnits<scalar_t> {
  QuantizedPagePools<scalar_t> pools;  // residual_slots on the host

  const float* key_row(int64_t unit, int64_t j, float* buffer) const { return row(unit, j, buffer, true); }
  const float* value_row(int64_t unit, int64_t j, float* buffer) const { return row(unit, j, buffer, false); }
  void prefetch(int64_t unit, int64_t j) const {
    if (j >= pools.full_tokens(this->lengths[unit / this->n])) return;  // the residual rows are few and read last
    const int64_t page = this->page(unit, j), offset = j % this->page_size * pools.code_bytes;
    for (int64_t b = 0; b < pools.code_bytes; b += 64) {
      __builtin_prefetch(pools.page(true, page).codes + offset + b);
      __builtin_prefetch(pools.page(false, page).codes + offset + b);
    }
  }

 private:
  const float* row(int64_t unit, int64_t j, float* buffer, bool keys) const {
    const int64_t bh = unit / this->n, full = pools.full_tokens(this->lengths[bh]);
    if (j >= full)
      return as_float<scalar_t>(
          pools.residual(keys, bh / this->kv_heads, bh % this->kv_heads, this->kv_heads, j - full), buffer, this->dim);
    run_per_isa<DequantizeRow>(pools.codec, keys, pools.page(keys, this->page(unit, j)), j % this->page_size, this->dim,
                               buffer);
    return buffer;
  }
};

at::Tensor paged_attention_quantized_cpu(const at::Tensor& queries, const at::Tensor& key_codes,
                                         const at::Tensor& key_scales, const at::Tensor& value_codes,
                                         const at::Tensor& value_scales, c10::string_view format_name,
                                         const at::Tensor& page_table, const at::Tensor& lengths,
                                         const at::Tensor& residual_keys, const at::Tensor& residual_values,
                                         const at::Tensor& residual_slots, std::optional<double> scale) {
  const KVFormat format = parse_kv_format(std::string(format_name), "paged_attention_quantized");
  const checks::QuantizedPagedAttentionArgs a = checks::quantized_paged_attention_args(
      queries, key_codes, key_scales, value_codes, value_scales, format, page_table, lengths, residual_keys,
      residual_values, residual_slots, scale);
  at::Tensor out = at::empty(a.queries.sizes(), a.queries.options());
  if (a.queries.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.queries.scalar_type(), "paged_attention_quantized", [&] {
    QuantizedPagedLayout<scalar_t> l;
    l.set_units(a.queries, a.host_page_table, a.host_lengths, a.key_codes.size(1), a.scale, out);
    l.pools = a.pools<scalar_t>(a.host_residual_slots);
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
  m.impl("paged_attention_quantized", &paged_attention_quantized_cpu);
}

}  // namespace kvpress::kernels
