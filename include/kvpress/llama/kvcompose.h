// KVCompose on the Llama runner: the context's prefill, the second pass, global budgets and the
// compression of every layer (docs/LLAMA_RUNNER.md, "KVComposePress"). The pass is the press's own
// (KVComposePress::run_second_pass, kvpress/model_view.h); this call runs it on a LlamaModel and
// reports what it measured.
//
//   kvpress::KVComposePress press(0.5);                        // or make_press("KVComposePress", 0.5)
//   kvpress::llama::KVCache cache = model.new_cache();
//   auto r = kvpress::llama::kvcompose_prefill(model, context_ids, cache, press);
//   // cache: structured -> layer l holds k_l tokens per head; unstructured -> head-ragged layers
//   // r.memory.peak_bytes: the extra memory the second pass held at its peak
//
// LlamaModel::prefill runs the same pass for a KVComposePress, so generation, eval and the demo run
// KVCompose like any press.
//
// The second pass (kvpress: the task prompt, by default the context again, forwarded over the
// cache in eager mode, growing it to ~2N tokens in every layer) runs LAYER BY LAYER and in QUERY
// CHUNKS: for each layer, the prompt's own keys/values exist for that layer only, each chunk of
// `query_chunk` prompt queries attends to the context plus the prompt keys up to itself, the
// chunk's attention to the N context tokens goes to the KVComposeSession (incremental max/mean),
// and the chunk's output feeds the next layer. Nothing of the prompt is written to the cache.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kvpress/llama/model.h"
#include "kvpress/presses/kvcompose_press.h"

namespace kvpress::llama {

using KVComposeRunOptions = kvpress::KVComposeRunOptions;  // kvpress/presses/kvcompose_press.h
using KVComposeMemory = kvpress::KVComposeMemory;

struct KVComposeResult {
  // The context's (uncompressed) prefill: logits, attentions when asked; then kept_indices
  // (structured, per layer [B, Hkv, k_l]) or keep_masks (unstructured, per layer [B, Hkv, N]).
  ForwardOutput prefill;
  KVComposeBudgets budgets;
  at::Tensor scores;  // [L, Hkv, N] float32: the session's token scores (KVComposeSession::scores)
  KVComposeMemory memory;
};

// Prefills context_ids [B, N] into the empty `cache`, runs the second pass and compresses every
// layer of the cache in place. From `prefill`: the ForwardOptions of the context's prefill
// (return_attentions, last_logits_only), ragged_layout (unstructured: kPacked stores
// HeadRaggedLayers, kMasked keeps the dense layer with a keep mask, kvpress's way) and the
// callbacks on_compress (structured) / on_compress_ragged (unstructured), called per layer with the
// layer's keys/values, layer_idx and num_layers; prefill.press is ignored.
KVComposeResult kvcompose_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                                  const KVComposePress& press, const KVComposeRunOptions& run = {},
                                  const PrefillOptions& prefill = {});

}  // namespace kvpress::llama
