// ThinKPress (kvpress 0.5.5's channel press). docs/PRESS_NOTES.md lists where it differs from kvpress.
#include "kvpress/presses/think_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {

ThinKPress::ThinKPress(double compression_ratio, const Params& params)
    : ThinKPress(compression_ratio, params.window_size) {}

ThinKPress::ThinKPress(double key_channel_compression_ratio, int64_t window_size)
    : key_channel_compression_ratio_(key_channel_compression_ratio), window_size_(window_size) {
  check_params("ThinKPress", Params{window_size});
  TORCH_CHECK(key_channel_compression_ratio >= 0.0 && key_channel_compression_ratio < 1.0,
              "ThinKPress: key_channel_compression_ratio must be in [0, 1), got ", key_channel_compression_ratio);
}

at::Tensor ThinKPress::channel_scores(const LayerInputs& in) const {
  constexpr const char* op = "ThinKPress";
  checks::check_kv(op, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), d = in.keys.size(3);
  // The last window_size queries (all of them on a shorter input, as kvpress's slice does).
  const at::Tensor q = ops::window_queries(in, std::min(window_size_, seq), op).to(at::kFloat);  // [B, Hq, w, D]
  checks::check_gqa(op, q.size(1), kv_heads);
  const at::Tensor query_power = q.square().mean(2).view({batch, kv_heads, -1, d}).mean(2);  // [B, Hkv, D]
  at::Tensor key_power = at::empty({batch, kv_heads, d}, query_power.options());
  for (int64_t h = 0; h < kv_heads; ++h)  // one head's squares at a time
    key_power.select(1, h).copy_(in.keys.select(1, h).to(at::kFloat).square().mean(1));
  return query_power * key_power;
}

at::Tensor ThinKPress::pruned_channels(const LayerInputs& in) const {
  const at::Tensor scores = channel_scores(in);
  const auto n_pruned = static_cast<int64_t>(static_cast<double>(scores.size(2)) * key_channel_compression_ratio_);
  if (n_pruned == 0) return at::empty({scores.size(0), scores.size(1), 0}, scores.options().dtype(at::kLong));
  // The lowest scores are the highest of their negation (scores are >= 0: -0 ties +0).
  return ops::topk_indices(scores.neg(), n_pruned);
}

KV ThinKPress::compress(const LayerInputs& in) const {
  checks::check_kv("ThinKPress.compress", in.keys, in.values);
  if (key_channel_compression_ratio_ == 0.0) return budget::keep_all(in);  // kvpress returns the cache untouched
  const at::Tensor pruned = pruned_channels(in);                           // [B, Hkv, n]
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  at::Tensor keys = in.keys.clone(at::MemoryFormat::Contiguous);
  keys.scatter_(3, pruned.unsqueeze(2).expand({batch, kv_heads, seq, pruned.size(2)}), 0);
  const at::Tensor kept = at::arange(seq, pruned.options()).expand({batch, kv_heads, seq}).contiguous();
  return KV{keys, in.values, kept};
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "ThinKPress", PressKind::kChannel,
      "ThinK: zeroes the key channels the last queries use least (ratio = fraction of key channels; every token kept)",
      window_query_inputs(), from_params<ThinKPress>};
});

}  // namespace

}  // namespace kvpress
