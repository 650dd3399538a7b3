#include "layer_slices.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kvpress/ops.h"

namespace kvpress {

int64_t known_num_heads(const LayerInputs& in) {
  if (in.num_heads > 0) return in.num_heads;
  if (!in.queries.defined() && !in.attentions.defined() && !in.q_proj.defined()) return 0;
  try {
    return ops::num_query_heads(in);
  } catch (const c10::Error&) {
    return 0;  // inconsistent shapes: the inner press reports them
  }
}

int64_t query_rows(const LayerInputs& in) {
  if (in.attentions.defined()) return in.attentions.size(2);
  if (in.queries.defined()) return in.queries.size(2);
  if (in.hidden_states.defined()) return in.hidden_states.size(1);
  return in.keys.size(2);
}

int64_t clamped_window(const LayerInputs& in, int64_t window_size) {
  return std::max<int64_t>(1, std::min({window_size, query_rows(in), in.keys.size(2)}));
}

LayerInputs slice_positions(const LayerInputs& in, int64_t begin, int64_t end) {
  const int64_t seq = in.keys.size(2), len = end - begin;
  LayerInputs out = in;
  out.num_heads = known_num_heads(in);
  out.keys = in.keys.narrow(2, begin, len);
  out.values = in.values.narrow(2, begin, len);
  if (in.hidden_states.defined() && in.hidden_states.dim() == 3 && in.hidden_states.size(1) == seq)
    out.hidden_states = in.hidden_states.narrow(1, begin, len);
  if (in.input_ids.defined() && in.input_ids.dim() == 2 && in.input_ids.size(1) == seq)
    out.input_ids = in.input_ids.narrow(1, begin, len);
  if (in.cos.defined() && in.cos.dim() == 2 && in.cos.size(0) == seq) out.cos = in.cos.narrow(0, begin, len);
  if (in.sin.defined() && in.sin.dim() == 2 && in.sin.size(0) == seq) out.sin = in.sin.narrow(0, begin, len);
  // Rows of the last q_len positions that fall in [begin, end).
  auto rows = [&](const at::Tensor& t) -> at::Tensor {
    const int64_t q_len = t.size(2), first = seq - q_len;
    const int64_t lo = std::max(begin, first);
    if (lo >= end) return at::Tensor();
    return t.narrow(2, lo - first, end - lo);
  };
  if (in.queries.defined() && in.queries.dim() == 4 && in.queries.size(2) <= seq) out.queries = rows(in.queries);
  if (in.attentions.defined() && in.attentions.dim() == 4 && in.attentions.size(2) <= seq &&
      in.attentions.size(3) == seq) {
    out.attentions = rows(in.attentions);
    if (out.attentions.defined()) out.attentions = out.attentions.narrow(3, begin, len);
  }
  return out;
}

LayerInputs kv_only(const LayerInputs& in, const at::Tensor& keys, const at::Tensor& values) {
  LayerInputs out;
  out.keys = keys;
  out.values = values;
  out.num_heads = known_num_heads(in);
  out.layer_idx = in.layer_idx;
  out.num_layers = in.num_layers;
  out.inv_freq = in.inv_freq;
  out.kv_head_range = in.kv_head_range;
  out.head_exchange = in.head_exchange;
  return out;
}

}  // namespace kvpress
