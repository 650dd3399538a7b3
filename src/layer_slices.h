// Views of a layer's inputs that wrappers hand to their inner presses (private): the inputs
// restricted to a range of positions, or to new keys/values only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kvpress/types.h"

namespace kvpress {

// Hq when it is known (num_heads, or queries, attentions or q_proj to infer it from), else 0.
int64_t known_num_heads(const LayerInputs& inputs);

// Query rows the inputs hold (kvpress: the forward's q_len, hidden_states.shape[1]): the given
// attentions' rows, else the given queries', else hidden_states' positions, else S.
int64_t query_rows(const LayerInputs& inputs);

// A window of the last `window_size` queries as the inputs allow it: clamped to the query rows they
// hold and to S, at least 1 (DropKVPress, RKVPress: the pull request's and the authors' q_len clamp).
int64_t clamped_window(const LayerInputs& inputs, int64_t window_size);

// The inputs restricted to positions [begin, end): keys, values, hidden_states and cos/sin are
// cut; queries and attention rows cover the last q_len positions, and only those inside the range
// are kept (none left: the tensor is dropped); attention columns are cut, not renormalised.
// num_heads is set when known, so it survives a dropped tensor.
LayerInputs slice_positions(const LayerInputs& inputs, int64_t begin, int64_t end);

// Only `keys` / `values` ([B, Hkv, n, D], e.g. a subset of the layer's tokens) and what does not
// depend on positions: num_heads (when known), layer_idx, num_layers, inv_freq, kv_head_range, head_exchange.
LayerInputs kv_only(const LayerInputs& inputs, const at::Tensor& keys, const at::Tensor& values);

}  // namespace kvpress
