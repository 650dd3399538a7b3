// kvpress::distributed: presses over tensor-parallel ranks that each hold a block of a layer's KV
// heads (and their query heads), as engines shard attention, over torch.distributed's c10d process
// groups (Gloo on CPU; an engine passes the group it already has): the group, the head shards, the
// configuration check every rank makes at setup, and two budget modes: per rank (each rank keeps
// (1 - r) of its own tokens, compactor-vllm's) and global (as one process would); and the
// compressed KV transfer from a prefill worker's PagedKVCache to a decode worker's (disaggregated
// serving) over point-to-point messages. docs/DISTRIBUTED.md.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvpress/paged.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/types.h"

namespace kvpress::distributed {

// How a layer's budget is set across ranks: per rank (each rank compresses its heads alone), or
// global (every rank keeps what one process compressing the whole layer keeps of its heads: the
// presses whose scores or budgets span heads exchange them, BasePress::head_span()).
enum class BudgetMode { kPerRank, kGlobal };
const char* budget_mode_name(BudgetMode mode);  // "per_rank", "global"

// The KV heads of one rank: a contiguous block of kv_heads / world heads, rank r holding heads
// r·count .. r·count + count - 1 (and query heads G times those), as vLLM and TensorRT-LLM shard.
struct HeadShard {
  int64_t rank = 0;
  int64_t world = 1;
  int64_t kv_heads = 1;  // of the whole layer
  int64_t count() const { return kv_heads / world; }
  int64_t first() const { return rank * count(); }
};
// Checks 0 <= rank < world and that world divides kv_heads.
HeadShard head_shard(int64_t kv_heads, int64_t rank, int64_t world);

// Rank shard.rank's share of a whole layer's inputs (num_heads must be set or inferable from
// queries/attentions/q_proj): its KV heads, their query heads, and those heads' rows or columns of
// q_proj, k_proj, their biases and o_proj; what every head shares (hidden states, RoPE tables, token
// ids, ...) as it is. Copies (contiguous), so a rank may drop the whole layer.
LayerInputs rank_share(const LayerInputs& layer, const HeadShard& shard);

// A Gloo process group of `world` processes on this machine (or sharing a file system) meeting at
// the file `store_path` (absent or empty before the first rank starts; one per group). Every
// collective, the rendezvous included, fails with a c10::Error after `timeout` instead of waiting
// for a rank that died or never came. Returns once every rank has joined (a first barrier); ranks
// may be processes or threads of one process.
c10::intrusive_ptr<c10d::ProcessGroup> gloo_group(const std::string& store_path, int rank, int world,
                                                  std::chrono::milliseconds timeout);

// Every rank of `group` passes the same named numbers (a configuration); one all-gather compares
// them, and each rank raises "<owner>: rank r (<mine_text>) differs from: rank 1: <name> <value>
// (here <value>); ..." naming every rank that differs and how. A rank that left or timed out makes
// the others raise "<owner>: rank r of w: the setup's all-gather failed (...)".
void check_agreement(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const std::vector<std::pair<std::string, double>>& fields, const std::string& owner,
                     const std::string& mine_text);

// The head exchange over every rank of `group` (all-gathers and all-reduces; its errors start with
// "<owner>: rank r of w"): what a ShardedPress in global mode gives its press, and what a
// tensor-parallel model (kvpress/llama/tensor_parallel.h) sums its partial projections with.
std::shared_ptr<const HeadExchange> group_head_exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                        const std::string& owner);

// Why `press` cannot compress one rank's share of a layer's heads, or "" when it can: its head_span
// is whole_layer, or it needs a second pass over the model, or it compresses while decoding.
std::string why_not_sharded(const BasePress& press);

// The same with torch's NCCL backend, for CUDA tensors (each rank on its own GPU; an engine on GPUs
// usually passes the NCCL group it already has). Built with the CUDA build only (KVPRESS_WITH_CUDA;
// elsewhere it raises saying so). Not run on a GPU yet: the GPU check runs it (issue 38).
c10::intrusive_ptr<c10d::ProcessGroup> nccl_group(const std::string& store_path, int rank, int world,
                                                  std::chrono::milliseconds timeout);

// What a rank's ShardedPress exchanged in its compressions so far (global mode; per-rank mode
// exchanges nothing per layer): counted by the rank, waiting for the others included in the time.
struct ExchangeStats {
  int64_t collectives = 0;     // all-gathers and all-reduces
  int64_t bytes_sent = 0;      // this rank's payload: its tensor in each collective
  int64_t bytes_received = 0;  // the other ranks' payloads it received or summed in: (world - 1)·payload each
  double seconds = 0.0;        // wall time inside the collectives
};

// A press compressing one rank's share of every layer. In global mode one thread at a time calls a
// ShardedPress's compressions (every rank's collectives must come in the same order).
class ShardedPress {
 public:
  // Every rank of `group` constructs one with the same press (name and parameters), mode and
  // kv_heads: one all-gather compares them, and each rank raises naming the ranks that differ.
  // Raises for a press that cannot be sharded (head_span() kWholeLayer), one that needs a second
  // pass, or one that compresses while decoding.
  ShardedPress(std::shared_ptr<const BasePress> press, c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t kv_heads,
               BudgetMode mode);

  const HeadShard& shard() const { return shard_; }
  BudgetMode mode() const { return mode_; }
  // The exchanges of every compression so far (zero in per-rank mode).
  ExchangeStats exchange_stats() const;

  // `local` holds this rank's heads: keys/values [B, kv_heads / world, S, D], queries or
  // attentions of its query heads, and for presses that read projections the rows or columns of
  // its heads. Per rank: the press on these heads alone. Global: what the press keeps of these
  // heads compressing the whole layer (every rank calls it for the same layer; presses that span
  // heads exchange their sums or scores).
  KV compress(const LayerInputs& local) const;
  // The same for every press, head-ragged ones (AdaKVPress, CriticalAdaKVPress, ...) included: per
  // rank, their head budgets are set across the rank's heads alone; global, across every rank's.
  RaggedKV compress_ragged(const LayerInputs& local) const;

 private:
  // `local`, checked to hold this rank's heads, with the head exchange set in global mode.
  LayerInputs share(const LayerInputs& local, const char* op) const;

  std::shared_ptr<const BasePress> press_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  HeadShard shard_;
  BudgetMode mode_;
  std::shared_ptr<const HeadExchange> exchange_;  // global mode
};

// ---- compressed KV transfer: prefill worker -> decode worker ------------------------------------
//
// The prefill worker compresses while storing (PagedKVCache::store with a press) and sends the
// sequence's kept tokens; the decode worker adopts them into its own PagedKVCache
// (adopt_sequence: any page size and pool) and decodes on as the prefill worker would have. What
// crosses: a 64-byte preamble, a header of (layers * (kv_heads + 1) + token_ids) int64 (each head's
// length, each layer's next position, the caller's token ids), each kept token's position (int32)
// and its keys and values in the cache's dtype; the receiver answers with one int64 (adopted or
// why not), so the sender knows whether it may free its copy. The messages are host tensors over a
// Gloo group (a cache on a GPU goes through host memory) and device tensors over a group with a CUDA
// backend (NCCL: written, not yet run on GPUs; two ranks need two GPUs).

// What one transfer moved (the sender's view; the receiver reports the same counts).
struct TransferStats {
  int64_t tokens = 0;          // stored tokens over every (layer, head)
  int64_t kv_bytes = 0;        // their keys and values: tokens * 2 * head_dim * element size
  int64_t position_bytes = 0;  // their positions: 4 bytes each
  int64_t header_bytes = 0;    // the preamble and header: bounded by the model's shape and token_ids
  double seconds = 0.0;        // wall time from the first message to the receiver's answer
  int64_t bytes() const { return kv_bytes + position_bytes + header_bytes; }
};

// Sends sequence `seq` of `cache` to rank `dst` of `group`, with `token_ids` (say, the prefill's first
// generated token) alongside, and waits for the receiver to adopt it. The sequence stays in `cache`
// (free it once this returns). Raises naming the step on a timeout or a departed receiver, and when
// the receiver refused the sequence (a cache of another shape or dtype, or too few free pages).
TransferStats send_sequence(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int dst, const PagedKVCache& cache,
                            SequenceId seq, const std::vector<int64_t>& token_ids = {}, int tag = 0);

struct ReceivedSequence {
  SequenceId seq = -1;             // the new sequence in the receiver's cache
  std::vector<int64_t> token_ids;  // what the sender passed along
  TransferStats stats;
};
// Receives one sequence from rank `src` of `group` into `cache` (PagedKVCache::adopt_sequence).
// Raises, after answering the sender, when the sequence does not fit the cache; on a timeout or a
// departed sender, naming the step. The cache is unchanged whenever it raises.
ReceivedSequence receive_sequence(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int src, PagedKVCache& cache,
                                  int tag = 0);

}  // namespace kvpress::distributed
