// kvpress::llama over tensor-parallel ranks (docs/DISTRIBUTED.md, "A sharded model"): each rank of
// a c10d process group runs its shard of the model (its block of KV heads and of the MLP, partial
// outputs summed over the group), its own KV cache of its heads, and the same calls as every other
// rank, so that continuous batching over PagedKVCache runs across ranks unchanged:
//
//   auto group = kvpress::distributed::gloo_group(store, rank, world, std::chrono::seconds(60));
//   const LlamaModel shard = kvpress::llama::tensor_parallel_shard(checkpoint.model, group,
//                                                                  kvpress::distributed::BudgetMode::kGlobal);
//   auto run = kvpress::llama::generate_paged(shard, prompts, options);  // every rank: the same tokens
//
// Not in kvpress/llama/llama.h (it brings torch's c10d headers).
#pragma once

#include "kvpress/distributed.h"
#include "kvpress/llama/model.h"

namespace kvpress::llama {

// Rank group->getRank()'s shard of `model` (LlamaModel::shard) over `group`, its projections summed
// with a group_head_exchange. Every rank of the group calls it with the same model and budgets: one
// all-gather compares layers, heads, sizes, vocabulary, dtype, budgets and world, and each rank
// raises naming the ranks that differ. Raises unless the world size divides the KV heads and the
// intermediate size.
LlamaModel tensor_parallel_shard(const LlamaModel& model, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                 distributed::BudgetMode budgets);

}  // namespace kvpress::llama
