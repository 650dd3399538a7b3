// ops::paged_attention and ops::paged_write: the dispatcher entry points and the ATen composites
// (devices without a kernel; the reference of src/ops/paged/cpu/paged.cpp and src/ops/paged/cuda/paged.cu).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <optional>
#include <utility>

#include "checks.h"
#include "kvpress/ops.h"
#include "paged/paged.h"

namespace kvpress {
namespace {

std::atomic<bool>& device_argument_checks_flag() {
  static std::atomic<bool> on{checks::env_flag("KVPRESS_CHECK_DEVICE_ARGUMENTS", "kvpress")};
  return on;
}

std::atomic<DeviceErrorCheck> cuda_device_error_check{nullptr};

}  // namespace

void register_cuda_device_error_check(DeviceErrorCheck check) { cuda_device_error_check = check; }

namespace ops {

void set_device_argument_checks(bool on) { device_argument_checks_flag() = on; }
bool device_argument_checks() { return device_argument_checks_flag(); }

void check_device_errors(const c10::Device& device) {
  const DeviceErrorCheck check = cuda_device_error_check;
  if (device.is_cuda() && check != nullptr) check(device.has_index() ? device.index() : c10::DeviceIndex{-1});
}

at::Tensor paged_attention(const at::Tensor& queries, const at::Tensor& key_pool, const at::Tensor& value_pool,
                           const at::Tensor& page_table, const at::Tensor& lengths, std::optional<double> scale) {
  static const auto op =
      dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, std::optional<double>)>("kvpress::paged_attention");
  // The dispatcher routes by the tensors' device and an undefined tensor routes nowhere: name it first.
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"queries", &queries},
                                {"key_pool", &key_pool},
                                {"value_pool", &value_pool},
                                {"page_table", &page_table},
                                {"lengths", &lengths}})
    checks::check_defined("paged_attention", name, *t);
  return op.call(queries, key_pool, value_pool, page_table, lengths, scale);
}

at::Tensor paged_attention_quantized(const at::Tensor& queries, const at::Tensor& key_codes,
                                     const at::Tensor& key_scales, const at::Tensor& value_codes,
                                     const at::Tensor& value_scales, KVFormat format, const at::Tensor& page_table,
                                     const at::Tensor& lengths, const at::Tensor& residual_keys,
                                     const at::Tensor& residual_values, const at::Tensor& residual_slots,
                                     std::optional<double> scale) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, c10::string_view, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, std::optional<double>);
  static const auto op = dispatcher_op<Signature>("kvpress::paged_attention_quantized");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"queries", &queries},
                                {"key_codes", &key_codes},
                                {"key_scales", &key_scales},
                                {"value_codes", &value_codes},
                                {"value_scales", &value_scales},
                                {"page_table", &page_table},
                                {"lengths", &lengths},
                                {"residual_keys", &residual_keys},
                                {"residual_values", &residual_values},
                                {"residual_slots", &residual_slots}})
    checks::check_defined("paged_attention_quantized", name, *t);
  return op.call(queries, key_codes, key_scales, value_codes, value_scales, kv_format_name(format), page_table, lengths,
                 residual_keys, residual_values, residual_slots, scale);
}

void paged_write(at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& slots) {
  static const auto op =
      dispatcher_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "kvpress::paged_write");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"key_pool", &key_pool},
                                {"value_pool", &value_pool},
                                {"keys", &keys},
                                {"values", &values},
                                {"slots", &slots}})
    checks::check_defined("paged_write", name, *t);
  op.call(key_pool, value_pool, keys, values, slots);
}

at::Tensor composite::paged_attention(const at::Tensor& queries, const at::Tensor& key_pool,
                                      const at::Tensor& value_pool, const at::Tensor& page_table,
                                      const at::Tensor& lengths, std::optional<double> scale) {
  const checks::PagedAttentionArgs a =
      checks::paged_attention_args(queries, key_pool, value_pool, page_table, lengths, scale);
  const int64_t batch = queries.size(0), q_heads = queries.size(1), n = queries.size(2), dim = queries.size(3);
  const int64_t kv_heads = page_table.size(1), page_size = key_pool.size(1), group = q_heads / kv_heads;
  const int64_t* len = a.host_lengths.const_data_ptr<int64_t>();
  const at::Tensor flat_keys = a.key_pool.view({-1, dim}), flat_values = a.value_pool.view({-1, dim});
  at::Tensor out = at::empty_like(a.queries);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t m = len[b * kv_heads + h];
      // Slot of token t: page_table[b, h, t / page_size] * page_size + t % page_size.
      const at::Tensor tokens = at::arange(m, page_table.options());
      const at::Tensor slots =
          a.page_table[b][h].index_select(0, tokens.div(page_size, "floor")) * page_size + tokens.remainder(page_size);
      const at::Tensor k = flat_keys.index_select(0, slots).to(at::kFloat);          // [m, D]
      const at::Tensor v = flat_values.index_select(0, slots).to(at::kFloat);        // [m, D]
      const at::Tensor q = a.queries[b].narrow(0, h * group, group).to(at::kFloat);  // [G, n, D]
      at::Tensor logits = at::matmul(q, k.t()) * a.scale;                            // [G, n, m]
      // New token i is token m - n + i and sees tokens <= that.
      const at::Tensor hidden =
          at::arange(m, tokens.options()).unsqueeze(0) > (at::arange(n, tokens.options()) + (m - n)).unsqueeze(1);
      logits.masked_fill_(hidden, -std::numeric_limits<float>::infinity());
      out[b].narrow(0, h * group, group).copy_(at::matmul(at::softmax(logits, -1), v));
    }
  }
  return out;
}

at::Tensor composite::paged_attention_quantized(const at::Tensor& queries, const at::Tensor& key_codes,
                                                const at::Tensor& key_scales, const at::Tensor& value_codes,
                                                const at::Tensor& value_scales, KVFormat format,
                                                const at::Tensor& page_table, const at::Tensor& lengths,
                                                const at::Tensor& residual_keys, const at::Tensor& residual_values,
                                                const at::Tensor& residual_slots, std::optional<double> scale) {
  const checks::QuantizedPagedAttentionArgs a = checks::quantized_paged_attention_args(
      queries, key_codes, key_scales, value_codes, value_scales, format, page_table, lengths, residual_keys,
      residual_values, residual_slots, scale);
  const int64_t dim = queries.size(3), page_size = key_codes.size(1), num_pages = key_codes.size(0);
  const int64_t batch = page_table.size(0), kv_heads = page_table.size(1), max_pages = page_table.size(2);
  // Pages 0 .. num_pages - 1 dequantized, then residual row (r, h) as page num_pages + r * Hkv + h.
  const at::Tensor key_pool = at::cat({kv_dequantize(a.key_codes, a.key_scales, format, KVRole::kKeys, dim),
                                       a.residual_keys.to(at::kFloat).view({-1, page_size, dim})});
  const at::Tensor value_pool = at::cat({kv_dequantize(a.value_codes, a.value_scales, format, KVRole::kValues, dim),
                                         a.residual_values.to(at::kFloat).view({-1, page_size, dim})});
  at::Tensor table = at::zeros({batch, kv_heads, max_pages + 1}, a.host_page_table.options());
  table.narrow(2, 0, max_pages).copy_(a.host_page_table);
  const int64_t* len = a.host_lengths.const_data_ptr<int64_t>();
  const int64_t* slot = a.host_residual_slots.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      table[b][h][len[b * kv_heads + h] / page_size] = num_pages + slot[b] * kv_heads + h;
  return paged_attention(a.queries.to(at::kFloat), key_pool, value_pool, table.to(page_table.device()), lengths,
                         a.scale)
      .to(queries.scalar_type());
}

void composite::paged_write(at::Tensor& key_pool, at::Tensor& value_pool, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& slots) {
  checks::check_paged_write(key_pool, value_pool, keys, values, slots);
  const int64_t dim = key_pool.size(2);
  key_pool.view({-1, dim}).index_copy_(0, slots, keys);
  value_pool.view({-1, dim}).index_copy_(0, slots, values);
}

}  // namespace ops
}  // namespace kvpress

// ---- registration: torch.ops.kvpress (src/ops/library.cpp holds the library's root) ----------

namespace kvpress {

namespace {

// The schema's form of ops::composite::paged_attention_quantized (the format by name).
at::Tensor paged_attention_quantized_composite(const at::Tensor& queries, const at::Tensor& key_codes,
                                               const at::Tensor& key_scales, const at::Tensor& value_codes,
                                               const at::Tensor& value_scales, c10::string_view format,
                                               const at::Tensor& page_table, const at::Tensor& lengths,
                                               const at::Tensor& residual_keys, const at::Tensor& residual_values,
                                               const at::Tensor& residual_slots, std::optional<double> scale) {
  return ops::composite::paged_attention_quantized(queries, key_codes, key_scales, value_codes, value_scales,
                                                   parse_kv_format(std::string(format), "paged_attention_quantized"),
                                                   page_table, lengths, residual_keys, residual_values, residual_slots,
                                                   scale);
}

}  // namespace

// kvpress/paged.h's kernels.
TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def(
      "paged_attention(Tensor queries, Tensor key_pool, Tensor value_pool, Tensor page_table, Tensor lengths, "
      "float? scale=None) -> Tensor");
  m.def(
      "paged_attention_quantized(Tensor queries, Tensor key_codes, Tensor key_scales, Tensor value_codes, "
      "Tensor value_scales, str format, Tensor page_table, Tensor lengths, Tensor residual_keys, "
      "Tensor residual_values, Tensor residual_slots, float? scale=None) -> Tensor");
  m.def("paged_write(Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor keys, Tensor values, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("paged_attention", &ops::composite::paged_attention);
  m.impl("paged_write", &ops::composite::paged_write);
  m.impl("paged_attention_quantized", &paged_attention_quantized_composite);
}

}  // namespace kvpress
