#include "kvpress/presses/block_press.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "layer_slices.h"
#include "presses/registration.h"

namespace kvpress {

BlockPress::BlockPress(std::shared_ptr<const ScorerPress> press, int64_t block_size)
    : ScorerWrapperPress(std::move(press), "BlockPress"), block_size_(block_size) {
  check_params("BlockPress", Params{block_size});
}

at::Tensor BlockPress::kept_positions(const LayerInputs& in) const {
  constexpr const char* op = "BlockPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio() == 0.0) return budget::keep_all(in).kept_indices;
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  const int64_t block = std::min(block_size_, seq);
  const int64_t n_kept = ops::n_kept(seq, compression_ratio());
  const auto long_opts = in.keys.options().dtype(at::kLong);
  at::Tensor kept = at::arange(n_kept, long_opts).expand({batch, kv_heads, n_kept});
  // The candidates' keys and values are gathered into the same two buffers every round: a fresh
  // [B, Hkv, n_kept + block, D] pair per round would be written to new pages each time.
  const at::Tensor flat_keys = in.keys.reshape({-1, d}), flat_values = in.values.reshape({-1, d});
  const at::Tensor head_start = at::arange(batch * kv_heads, long_opts).mul_(seq).view({batch, kv_heads, 1});
  at::Tensor key_rows = at::empty({batch * kv_heads * (n_kept + block), d}, in.keys.options());
  at::Tensor value_rows = at::empty({batch * kv_heads * (n_kept + block), d}, in.values.options());
  for (int64_t start = n_kept; start < seq; start += block) {
    const int64_t end = std::min(start + block, seq), width = n_kept + end - start;
    const at::Tensor cand =
        at::cat({kept, at::arange(start, end, long_opts).expand({batch, kv_heads, end - start})}, -1).contiguous();
    const at::Tensor rows = (cand + head_start).view({-1});  // rows of the flattened [B·Hkv·S, D]
    at::Tensor k = key_rows.narrow(0, 0, rows.size(0)), v = value_rows.narrow(0, 0, rows.size(0));
    at::index_select_out(k, flat_keys, 0, rows);
    at::index_select_out(v, flat_values, 0, rows);
    const LayerInputs sub = kv_only(in, k.view({batch, kv_heads, width, d}), v.view({batch, kv_heads, width, d}));
    const at::Tensor scores = inner_scores(sub, op);
    kept = cand.gather(-1, ops::topk_indices(scores, n_kept));
  }
  return std::get<0>(kept.sort(-1)).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"BlockPress",
                    PressKind::kWrapper,
                    "block-iterative selection with the inner scorer",
                    {{}, {}, {}, "the inner press sees keys and values only"},
                    wrapper_from_params<BlockPress>};
});

}  // namespace

}  // namespace kvpress
