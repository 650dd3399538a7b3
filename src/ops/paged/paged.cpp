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

// kvpress/paged.h's kernels.
TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def(
      "paged_attention(Tensor queries, Tensor key_pool, Tensor value_pool, Tensor page_table, Tensor lengths, "
      "float? scale=None) -> Tensor");
  m.def("paged_write(Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor keys, Tensor values, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("paged_attention", &ops::composite::paged_attention);
  m.impl("paged_write", &ops::composite::paged_write);
}

}  // namespace kvpress
