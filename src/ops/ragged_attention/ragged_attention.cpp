// ops::ragged_attention over raw head-ragged storage: the dispatcher entry point and the ATen
// composite (devices without a kernel; the reference of its cpu/ and cuda/ kernels).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "checks.h"
#include "kvpress/ops.h"
#include "ragged_attention/ragged_attention.h"

namespace kvpress::ops {

at::Tensor ragged_attention(const at::Tensor& queries, const at::Tensor& packed_keys, const at::Tensor& packed_values,
                            const at::Tensor& offsets, const at::Tensor& tail_keys, const at::Tensor& tail_values,
                            std::optional<double> scale) {
  static const auto op =
      dispatcher_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, std::optional<double>)>(
          "kvpress::ragged_attention");
  // The dispatcher routes by the tensors' device and an undefined tensor routes nowhere: name it first.
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"queries", &queries},
                                {"packed_keys", &packed_keys},
                                {"packed_values", &packed_values},
                                {"offsets", &offsets},
                                {"tail_keys", &tail_keys},
                                {"tail_values", &tail_values}})
    checks::check_defined("ragged_attention", name, *t);
  return op.call(queries, packed_keys, packed_values, offsets, tail_keys, tail_values, scale);
}

at::Tensor composite::ragged_attention(const at::Tensor& queries, const at::Tensor& packed_keys,
                                       const at::Tensor& packed_values, const at::Tensor& offsets,
                                       const at::Tensor& tail_keys, const at::Tensor& tail_values,
                                       std::optional<double> scale) {
  const double s =
      checks::check_ragged_attention(queries, packed_keys, packed_values, offsets, tail_keys, tail_values, scale);
  const int64_t batch = queries.size(0), q_heads = queries.size(1), n = queries.size(2);
  const int64_t kv_heads = tail_keys.size(1), m = tail_keys.size(2), group = q_heads / kv_heads;
  const at::Tensor host = offsets.to(at::kCPU).contiguous();
  const int64_t* o = host.const_data_ptr<int64_t>();
  // New token i is tail slot m - n + i: it sees every packed row of its head and tail slots <= that.
  const at::Tensor tail_hidden = at::arange(m, offsets.options()).unsqueeze(0) >
                                 (at::arange(n, offsets.options()) + (m - n)).unsqueeze(1);  // [n, m]
  at::Tensor out = at::empty_like(queries, at::MemoryFormat::Contiguous);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t bh = b * kv_heads + h, packed = o[bh + 1] - o[bh];
      const at::Tensor k = at::cat({packed_keys.narrow(0, o[bh], packed), tail_keys[b][h]}).to(at::kFloat);
      const at::Tensor v = at::cat({packed_values.narrow(0, o[bh], packed), tail_values[b][h]}).to(at::kFloat);
      const at::Tensor q = queries[b].narrow(0, h * group, group).to(at::kFloat);  // [G, n, D]
      at::Tensor logits = at::matmul(q, k.t()) * s;                                // [G, n, packed + m]
      logits.narrow(2, packed, m).masked_fill_(tail_hidden, -std::numeric_limits<float>::infinity());
      out[b].narrow(0, h * group, group).copy_(at::matmul(at::softmax(logits, -1), v));
    }
  }
  return out;
}

}  // namespace kvpress::ops

// ---- registration: torch.ops.kvpress (src/ops/library.cpp holds the library's root) ----------

namespace kvpress {

TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def(
      "ragged_attention(Tensor queries, Tensor packed_keys, Tensor packed_values, Tensor offsets, "
      "Tensor tail_keys, Tensor tail_values, float? scale=None) -> Tensor");  // kernels
}

TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("ragged_attention", &ops::composite::ragged_attention);
}

}  // namespace kvpress
