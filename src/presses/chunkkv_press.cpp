#include "kvpress/presses/chunkkv_press.h"

#include <ATen/ATen.h>

#include <vector>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

at::Tensor ChunkKVPress::kept_positions(const LayerInputs& in) const {
  constexpr const char* op = "ChunkKVPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio() == 0.0) return budget::keep_all(in).kept_indices;
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t length = chunk_length();
  const int64_t n_full = seq / length, rest = seq % length;
  const LayerInputs no_attn = without_attentions(in);
  if (n_full == 0) return press()->kept_positions(no_attn);
  // [B, S] summed over every head (on a rank's share, over every rank's).
  const at::Tensor scores = head_exchange::sum_over_ranks(in, inner_scores(no_attn, op).sum(1));
  std::vector<at::Tensor> chunk_scores{scores.narrow(1, 0, n_full * length).view({batch, n_full, length}).mean(-1)};
  if (rest > 0) chunk_scores.push_back(scores.narrow(1, seq - rest, rest).mean(-1, true));
  const at::Tensor per_chunk = at::cat(chunk_scores, 1).sum(0).view({1, 1, -1});  // summed over the batch
  const int64_t n_chunks = per_chunk.size(2);
  const int64_t n_keep = ops::n_kept(n_chunks, compression_ratio());
  const at::Tensor chunks = ops::topk_indices(per_chunk, n_keep).flatten();  // ascending
  // Chunk c covers [c·chunk_length, min((c+1)·chunk_length, S)).
  const at::Tensor pos = at::arange(seq, in.keys.options().dtype(at::kLong));
  const at::Tensor keep = at::isin(pos.div(length, "floor"), chunks.to(pos.device()));
  const at::Tensor kept = pos.masked_select(keep);
  return kept.view({1, 1, -1}).expand({batch, kv_heads, kept.size(0)}).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"ChunkKVPress",
                    PressKind::kWrapper,
                    "inner scores averaged per chunk, best chunks kept whole",
                    {{}, {}, {}, "no attentions (kvpress refuses them)"},
                    wrapper_from_params<ChunkKVPress>};
});

}  // namespace

}  // namespace kvpress
