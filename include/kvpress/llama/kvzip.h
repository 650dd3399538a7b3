// KVzip (and FastKVzip) on the Llama runner: score every context token by replaying the context
// (FastKVzip: by its gates), then prefill with each layer compressed to the global selection
// (docs/LLAMA_RUNNER.md, "KVzipPress"). The passes are the presses' own (KVzipPress::run_second_pass,
// kvpress/model_view.h); these calls run them on a LlamaModel and report what they measured.
//
//   kvpress::KVzipPress press(0.5);                            // or make_press("KVzipPress", 0.5)
//   kvpress::llama::KVCache cache = model.new_cache();
//   auto r = kvpress::llama::kvzip_prefill(model, context_ids, cache, press, tokenizer);
//   // cache: head-ragged layers (or dense with keep masks); r.scores [L, Hkv, N]
//
// LlamaModel::prefill runs the same pass for any press that needs_second_pass() (with
// PrefillOptions::tokenizer set for KVzip's prompts), so generation, the pipeline, eval and the CLI
// run KVzip like any press.
//
// Memory. kvpress prefills the whole cache, then forwards each repeat chunk over it (the cache
// grows by the chunk in every layer until its hook cuts it back). Here the scoring pass runs LAYER
// BY LAYER over the context and every replay chunk together: a layer's context keys/values exist
// only while that layer is processed (with the replay's own keys/values of that layer), then are
// dropped; the replay's queries run in blocks of query_chunk rows. Once every layer is scored, the
// selection is global, and a second prefill (the ordinary one) stores each layer already
// compressed. So no full cache ever exists: the peak is the compressed cache plus one layer's full
// keys/values, plus the activations (the residual streams of the context and the replay chunks),
// at the price of one more prefill of compute (kvpress: prefill + replay; here 2 prefills + replay).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kvpress/llama/model.h"
#include "kvpress/llama/tokenizer.h"
#include "kvpress/presses/fastkvzip_press.h"
#include "kvpress/presses/kvgrad_press.h"
#include "kvpress/presses/kvzip_press.h"
#include "kvpress/presses/restorekv_press.h"

namespace kvpress::llama {

using KVzipRunOptions = kvpress::KVzipRunOptions;  // kvpress/presses/kvzip_press.h
using KVzipMemory = kvpress::KVzipMemory;
using KVgradRunOptions = kvpress::KVgradRunOptions;  // kvpress/presses/kvgrad_press.h

struct KVzipResult {
  ForwardOutput prefill;  // the second (compressing) prefill's output: logits, keep_masks per layer
  at::Tensor scores;      // [L, Hkv, N] float32: KVzip's token scores (before the sinks' + 1)
  KVzipMemory memory;
  // RestoreKVPress: what its restore tokens left in every layer, [L, Hkv, n, D] each (keys post-RoPE).
  at::Tensor restore_keys, restore_values;
};

// Scores context_ids [1, N] by KVzip's replay (the repeat prompts tokenized by `tokenizer`
// without special tokens; kvpress's texts for a model without a chat template), selects globally
// (KVzipPress::keep_masks) and prefills the empty `cache` with each layer compressed to its
// selection. From `prefill`: ForwardOptions, ragged_layout (kPacked: HeadRaggedLayers; kMasked:
// dense layers with keep masks, kvpress's way), on_compress_ragged; prefill.press is ignored.
// At ratio 0 it is the plain prefill (kvpress skips the replay). A failure leaves the cache as it was.
//
// A RestoreKVPress also runs its restore tokens (kvpress/presses/restorekv_press.h) through the
// scoring pass, layer by layer with its adapter: they attend to each layer's full context at
// positions N .. N + n - 1. The selection evicts at RestoreKVPress::eviction_ratio(N), then every
// layer gets the restore tokens' keys/values after its kept tokens and the cache's position becomes
// N + n. The scoring pass then holds the restore tokens' keys/values too (n per layer).
// A KVgradPress runs its own pass (kvgrad_prefill with the default KVgradRunOptions).
KVzipResult kvzip_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                          const KVzipPress& press, const Tokenizer& tokenizer, const PrefillOptions& prefill = {},
                          const KVzipRunOptions& run = {});

// ---- one scoring pass, every ratio (kvpress-cli bench) ------------------------------------------
// KVzip's token scores do not depend on the compression ratio, and its compressing prefill is the
// plain prefill's forward cut to the selection. So kvzip_scores() runs kvzip_prefill's scoring pass
// alone ([L, Hkv, N] float32: kvzip_prefill's result.scores at any ratio > 0), and
// kvzip_compress_captured() gives, for the press at any ratio, the cache kvzip_prefill leaves: its
// global selection of `scores` (KVzipPress::keep_masks) cut from a captured plain prefill of the same
// context (LlamaModel::capture_prefill), as LlamaModel::compress_captured() does for other presses
// (the same kept tokens, keys and values: tests/test_kvzip.cpp). Plain KVzipPress only:
// RestoreKVPress adds its restore tokens and KVgradPress scores by gradients (both raise). `scores`
// must come from a press with the same parameters but the ratio; options as compress_captured()'s.
// `press` as a plain KVzipPress (what kvzip_scores takes), or nullptr (another press, RestoreKVPress,
// KVgradPress): KVzipPress::plain.
inline const KVzipPress* plain_kvzip(const BasePress* press) { return KVzipPress::plain(press); }
// `captured` (optional): the plain prefill of context_ids, whose keys/values the scoring pass then
// reads instead of computing the context's path through every layer again (one prefill less).
at::Tensor kvzip_scores(const LlamaModel& model, const at::Tensor& context_ids, const KVzipPress& press,
                        const Tokenizer& tokenizer, const ChatTemplate* chat_template = nullptr,
                        const KVzipRunOptions& run = {}, const CapturedPrefill* captured = nullptr);
KVCache kvzip_compress_captured(const LlamaModel& model, const CapturedPrefill& captured, const KVzipPress& press,
                                const at::Tensor& scores, const PrefillOptions& options = {});

// KVgrad (KVgradPress::run_kvgrad_pass): KVzip's replay scored through the gradient of the last
// layer's outputs, then KVzip's selection and the compressing prefill. Runs outside inference mode.
// result.memory reports the recompute_context path's peak; result.scores as kvzip_prefill's.
KVzipResult kvgrad_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                           const KVgradPress& press, const Tokenizer& tokenizer, const PrefillOptions& prefill = {},
                           const KVgradRunOptions& run = {});

// FastKVzip with its global selection (layerwise = false): the same scoring pass without a replay
// (each layer's gate reads its attention input; the context's keys/values of one layer at a time),
// FastKVzipPress::keep_masks, then the compressing prefill. result.scores are the gates' scores
// (sinks and window at 1). LlamaModel::prefill runs the same pass for a FastKVzipPress that needs it; a
// layerwise one compresses layer by layer in the ordinary prefill.
KVzipResult fast_kvzip_prefill(const LlamaModel& model, const at::Tensor& context_ids, KVCache& cache,
                               const FastKVzipPress& press, const PrefillOptions& prefill = {});

}  // namespace kvpress::llama
