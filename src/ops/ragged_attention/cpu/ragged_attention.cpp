// CPU kernel of kvpress::ragged_attention: causal attention of n new tokens over a head-ragged layer
// (packed per-head rows, then a dense tail shared by every head), on the fused attention core of
// attention_core.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <vector>

#include "cpu/attention_core.h"
#include "ragged_attention/ragged_attention.h"

namespace kvpress::kernels {
namespace {

// Unit (b * Hkv + h) * n + i sees the packed rows of head (b, h), then tail rows 0 .. m - n + i.
template <typename scalar_t>
struct RaggedLayout : StoredRows<scalar_t, RaggedLayout<scalar_t>> {
  int64_t units, groups, dim;
  float scale;
  int64_t q_heads, n, kv_heads, m;
  const scalar_t *q_ptr, *pk, *pv, *tk, *tv;
  int64_t tk_b, tk_h, tk_s, tv_b, tv_h, tv_s;
  const int64_t* offsets;  // [B * Hkv + 1], host
  scalar_t* o_ptr;

  int64_t n_packed(int64_t bh) const { return offsets[bh + 1] - offsets[bh]; }
  int64_t n_visible(int64_t unit) const { return n_packed(unit / n) + (m - n + unit % n + 1); }
  const scalar_t* query(int64_t unit, int64_t g) const {
    const int64_t i = unit % n, bh = unit / n, b = bh / kv_heads, h = bh % kv_heads;
    return q_ptr + ((b * q_heads + h * groups + g) * n + i) * dim;
  }
  scalar_t* output(int64_t unit, int64_t g) const { return o_ptr + (query(unit, g) - q_ptr); }
  const scalar_t* row(const scalar_t* packed, const scalar_t* tail, int64_t tb, int64_t th, int64_t ts, int64_t unit,
                      int64_t j) const {
    const int64_t bh = unit / n, packed_rows = n_packed(bh);
    if (j < packed_rows) return packed + (offsets[bh] + j) * dim;
    return tail + (bh / kv_heads) * tb + (bh % kv_heads) * th + (j - packed_rows) * ts;
  }
  const scalar_t* key(int64_t unit, int64_t j) const { return row(pk, tk, tk_b, tk_h, tk_s, unit, j); }
  const scalar_t* value(int64_t unit, int64_t j) const { return row(pv, tv, tv_b, tv_h, tv_s, unit, j); }
};

at::Tensor ragged_attention_cpu(const at::Tensor& queries_in, const at::Tensor& packed_keys_in,
                                const at::Tensor& packed_values_in, const at::Tensor& offsets_in,
                                const at::Tensor& tail_keys_in, const at::Tensor& tail_values_in,
                                std::optional<double> scale_in) {
  const checks::RaggedAttentionArgs a = checks::ragged_attention_args(
      queries_in, packed_keys_in, packed_values_in, offsets_in, tail_keys_in, tail_values_in, scale_in);
  at::Tensor out = at::empty(a.queries.sizes(), a.queries.options());
  if (a.queries.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.queries.scalar_type(), "ragged_attention_cpu", [&] {
    RaggedLayout<scalar_t> l;
    l.q_heads = a.queries.size(1);
    l.n = a.queries.size(2);
    l.dim = a.queries.size(3);
    l.kv_heads = a.tail_keys.size(1);
    l.m = a.tail_keys.size(2);
    l.groups = l.q_heads / l.kv_heads;
    l.units = a.queries.size(0) * l.kv_heads * l.n;
    l.scale = static_cast<float>(a.scale);
    l.q_ptr = a.queries.const_data_ptr<scalar_t>();
    l.pk = a.packed_keys.const_data_ptr<scalar_t>();
    l.pv = a.packed_values.const_data_ptr<scalar_t>();
    l.tk = a.tail_keys.const_data_ptr<scalar_t>();
    l.tv = a.tail_values.const_data_ptr<scalar_t>();
    l.tk_b = a.tail_keys.stride(0);
    l.tk_h = a.tail_keys.stride(1);
    l.tk_s = a.tail_keys.stride(2);
    l.tv_b = a.tail_values.stride(0);
    l.tv_h = a.tail_values.stride(1);
    l.tv_s = a.tail_values.stride(2);
    l.offsets = a.offsets.const_data_ptr<int64_t>();  // CPU: the offsets are on the queries' device
    l.o_ptr = out.data_ptr<scalar_t>();
    run_attention<scalar_t>(l);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("ragged_attention", &ragged_attention_cpu); }

}  // namespace kvpress::kernels
