#include "kvpress/presses/chunk_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "layer_slices.h"
#include "presses/registration.h"

namespace kvpress {

at::Tensor ChunkPress::kept_positions(const LayerInputs& in) const {
  constexpr const char* op = "ChunkPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio() == 0.0) return budget::keep_all(in).kept_indices;
  const int64_t seq = in.keys.size(2);
  TORCH_CHECK(!in.queries.defined() || (in.queries.dim() == 4 && in.queries.size(2) == seq), op,
              ": queries must cover all positions ([batch, num_heads, ", seq, ", head_dim]), got ",
              checks::shape_str(in.queries));
  const LayerInputs no_attn = without_attentions(in);
  std::vector<at::Tensor> kept;
  for (int64_t start = 0; start < seq; start += chunk_length()) {
    const int64_t len = std::min(chunk_length(), seq - start);
    LayerInputs chunk = slice_positions(no_attn, start, start + len);
    // kvpress hands the full tables to the inner press, whose window reads their tail.
    if (in.cos.defined() && in.cos.dim() == 2 && in.cos.size(0) >= len)
      chunk.cos = in.cos.narrow(0, in.cos.size(0) - len, len);
    if (in.sin.defined() && in.sin.dim() == 2 && in.sin.size(0) >= len)
      chunk.sin = in.sin.narrow(0, in.sin.size(0) - len, len);
    const at::Tensor scores = inner_scores(chunk, op);
    kept.push_back(ops::topk_indices(scores, ops::n_kept(len, compression_ratio())) + start);
  }
  return at::cat(kept, -1).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"ChunkPress",
                    PressKind::kWrapper,
                    "inner press applied to each chunk independently",
                    {{}, {}, {}, "no attentions (kvpress refuses them)"},
                    wrapper_from_params<ChunkPress>};
});

}  // namespace

}  // namespace kvpress
