// The layer the distributed tests compress: the same on every rank and in the test process, and one
// rank's share of it (kvpress::distributed::HeadShard).
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "kvpress/distributed.h"
#include "kvpress/types.h"

namespace kvpress::testing {

// B = 1, Hkv = 4 (so 2 and 4 ranks divide it), Hq = 8, S = 96, D = 16; keys, values and the
// queries of every position, seeded. Head h's keys are scaled by 1 + h/2, so that presses setting
// budgets across heads (AdaKVPress over key norms) give the heads different ones.
inline LayerInputs distributed_layer(uint64_t seed = 7) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  LayerInputs in;
  in.keys = at::randn({1, 4, 96, 16}, generator) * (at::arange(4, at::kFloat) * 0.5 + 1).view({1, 4, 1, 1});
  in.values = at::randn({1, 4, 96, 16}, generator);
  in.queries = at::randn({1, 8, 96, 16}, generator);
  in.num_heads = 8;
  return in;
}

// Rank shard.rank's share of `in` (num_heads set): its KV heads, their query heads, and the rows or
// columns of those heads in the projections; what every head shares (hidden states, RoPE tables,
// token ids, ...) as it is.
inline LayerInputs rank_share(const LayerInputs& in, const distributed::HeadShard& shard) {
  const int64_t groups = in.num_heads / in.keys.size(1), d = in.keys.size(3);
  const int64_t kv_first = shard.first(), kv_count = shard.count();
  const int64_t q_first = kv_first * groups, q_count = kv_count * groups;
  const auto cut = [](const at::Tensor& t, int64_t dim, int64_t first, int64_t count) {
    return t.defined() ? t.narrow(dim, first, count).contiguous() : t;
  };
  LayerInputs local = in;
  local.keys = cut(in.keys, 1, kv_first, kv_count);
  local.values = cut(in.values, 1, kv_first, kv_count);
  local.queries = cut(in.queries, 1, q_first, q_count);
  local.attentions = cut(in.attentions, 1, q_first, q_count);
  local.q_proj = cut(in.q_proj, 0, q_first * d, q_count * d);
  local.q_bias = cut(in.q_bias, 0, q_first * d, q_count * d);
  local.k_proj = cut(in.k_proj, 0, kv_first * d, kv_count * d);
  local.k_bias = cut(in.k_bias, 0, kv_first * d, kv_count * d);
  local.o_proj = cut(in.o_proj, 1, q_first * d, q_count * d);
  local.num_heads = q_count;
  return local;
}

}  // namespace kvpress::testing
