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
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t block = std::min(block_size_, seq);
  const int64_t n_kept = ops::n_kept(seq, compression_ratio());
  const auto long_opts = in.keys.options().dtype(at::kLong);
  at::Tensor kept = at::arange(n_kept, long_opts).expand({batch, kv_heads, n_kept});
  for (int64_t start = n_kept; start < seq; start += block) {
    const int64_t end = std::min(start + block, seq);
    const at::Tensor cand =
        at::cat({kept, at::arange(start, end, long_opts).expand({batch, kv_heads, end - start})}, -1).contiguous();
    const KV rows = ops::gather_kv(in.keys, in.values, cand);  // the candidates' keys and values
    const LayerInputs sub = kv_only(in, rows.keys, rows.values);
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
