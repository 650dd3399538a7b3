// The steps of presses whose scores or budgets span KV heads (HeadSpan::kExchanged), written once
// for the whole layer and for one rank's share of it (LayerInputs::head_exchange set): on a share
// they reach the other ranks' heads, on the whole layer they are the identity.
#pragma once

#include <ATen/core/Tensor.h>

#include "kvpress/types.h"

namespace kvpress::head_exchange {

// local: [B, n, ...] rows of the heads `in` holds -> the same rows of every head of the layer.
inline at::Tensor all_heads(const LayerInputs& in, const at::Tensor& local) {
  return in.head_exchange ? in.head_exchange->gather_heads(local) : local;
}

// full: [B, H, ...] rows of every KV head of the layer -> the rows of the KV heads `in` holds.
inline at::Tensor own_kv_heads(const LayerInputs& in, const at::Tensor& full) {
  return in.head_exchange ? full.narrow(1, in.head_exchange->first_kv_head(), in.keys.size(1)) : full;
}

// A sum over the heads `in` holds -> the sum over every head of the layer.
inline at::Tensor sum_over_ranks(const LayerInputs& in, const at::Tensor& partial) {
  return in.head_exchange ? in.head_exchange->sum_over_ranks(partial) : partial;
}

// The number of ranks the layer's heads are spread over (1 on the whole layer).
inline int64_t ranks(const LayerInputs& in) {
  return in.head_exchange ? in.head_exchange->layer_kv_heads() / in.keys.size(1) : 1;
}

}  // namespace kvpress::head_exchange
