// The KVzip family's second pass, shared by kvzip_pass.cpp (KVzipPress, RestoreKVPress,
// FastKVzipPress) and kvgrad_pass.cpp (KVgradPress).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "kvpress/model_view.h"
#include "kvpress/presses/kvzip_press.h"

namespace kvpress::detail {

// Keeps the largest footprint seen, with the breakdown of that moment.
void record_peak(KVzipMemory& m, int64_t layer_kv, int64_t activations, int64_t attention, int64_t scores);

// The checks every KVzip-family pass makes of run.context_ids() (a non-empty int64 [1, N]: batch 1,
// as kvpress); returns the full cache's bytes (KVzipMemory::full_cache_bytes).
int64_t check_kvzip_context(const SecondPassRun& run);

// The context's replay chunks as kvpress frames them. Without a chat template the context is plain
// text: every token is replayed, each chunk after "\n". With one (run.user_turn_frame()), the text
// before the user's message is not replayed (kvpress skips its token count) and the text after it
// (end of turn, the assistant's header) comes between each prompt and its chunk.
std::vector<KVzipReplayChunk> framed_replay_chunks(const KVzipPress& press, const SecondPassRun& run);

// A KVzip-family selection, keep_masks ([L, Hkv, N] scores -> L x [1, Hkv, N] bool), of the scores of
// the heads `model` holds. On a tensor-parallel shard with global budgets it is made over every
// rank's heads (the scores gathered: L·Hkv·N floats from each rank) and this rank takes its heads'
// rows, as one process selects; per rank (no exchange), over this rank's heads alone.
using KeepMasksFn = std::function<std::vector<at::Tensor>(const at::Tensor& scores)>;
std::vector<at::Tensor> keep_masks_over_ranks(const ModelView& model, const at::Tensor& scores,
                                              const KeepMasksFn& keep_masks);

// Scores a layer's context tokens from its attention input: [1, Hkv, N] float32.
using ContextScorer = std::function<at::Tensor(int64_t layer, const LayerQKV& context)>;
// Every context token's scores, [L, Hkv, N] float32: the context goes through run's model layer by
// layer (one layer's keys/values at a time) and `scorer` scores each layer's (FastKVzipPress's
// gates, LayerDefensiveKVPress's per-layer scores). `memory` records the peak.
at::Tensor context_scores(const SecondPassRun& run, const ContextScorer& scorer, KVzipMemory& memory);

// The ordinary prefill with each layer compressed to masks[l] [1, Hkv, N] right after its attention.
void prefill_selected(SecondPassRun& run, const BasePress& press, std::vector<at::Tensor> masks);

}  // namespace kvpress::detail
